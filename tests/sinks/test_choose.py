"""The article's table from capacity records: values, ratios to MHA, recommendations derived from the
numbers (changing the numbers changes them), quality when the records hold it, the plot's data."""

from rich.console import Console

from kvbench.sinks.choose import RULES, choices, recommend
from kvbench.sinks.console import sweep_tables
from kvbench.sinks.plots import capacity_panels, draw_all
from kvbench.sinks.report import write_report


def capacity_record(job, kind, kv, max_batches, predicted, kv_per_token, decode_ms=1.0, stopped="memory"):
    contexts = sorted(max_batches)
    return {
        "job": str(job), "status": "ok",
        "config": {"task": "capacity", "model": {"name": "small"}, "attention": {"type": kind, "num_kv_heads": kv},
                   "workload": {"name": "decode", "gen_len": 8}, "runtime": {"memory_budget_gb": 0.25},
                   "capacity": {"context_lens": contexts}},
        "metrics": {"max_batch_longest": max_batches[contexts[-1]], "stopped_by_longest": stopped,
                    "decode_ms_p50_longest": decode_ms, "tokens_per_s_longest": 100.0 * kv,
                    "kv_bytes_per_token": kv_per_token, "probes_run": 5},
        "tables": {"capacity": [{"context": c, "max_batch": max_batches[c], "predicted_max_batch": predicted[c]}
                                for c in contexts]},
    }


def sweep(mha=10, gqa=30, mqa=40):
    return [capacity_record(0, "mha", 8, {128: 2 * mha, 256: mha}, {128: 2 * mha + 1, 256: mha + 1}, 4096, 2.0),
            capacity_record(1, "gqa", 2, {128: 2 * gqa, 256: gqa}, {128: 2 * gqa, 256: gqa}, 1024, 1.5),
            capacity_record(2, "mqa", 1, {128: 2 * mqa, 256: mqa}, {128: 2 * mqa, 256: mqa}, 512, 1.4, "tpot")]


def test_table_values_and_fraction_of_mha():
    (choice,) = choices(sweep())
    rows = {r[0]: dict(zip(choice.header, r)) for r in choice.rows}
    assert list(rows) == ["mha kv=8", "gqa kv=2", "mqa kv=1"]
    assert rows["gqa kv=2"]["vs MHA"] == "0.250" and rows["mqa kv=1"]["vs MHA"] == "0.125"
    assert rows["mha kv=8"]["KV / token (at longest)"] == "4.00 KiB"
    assert rows["mqa kv=1"]["max batch"] == "40" and rows["mqa kv=1"]["stopped by"] == "tpot"
    assert rows["mha kv=8"]["context"] == "256" and rows["mha kv=8"]["memory-only prediction"] == "11"
    assert "perplexity" not in choice.header
    assert any(n.startswith("quality: no ok task=train or task=eval job") for n in choice.notes)


def test_recommendations_follow_the_numbers():
    lines = dict(choices(sweep())[0].recommendations)
    assert lines["memory tight"].startswith("mqa kv=1:")
    assert lines["memory ample"].startswith("gqa kv=2:")  # 30 >= 50% of 40, MHA's 10 is not
    assert lines["multi-turn"].startswith("mqa kv=1 with cache.shared=true is the article's advice, not measured")
    # other numbers, other answers: MHA holding 25 of 40 is ample; GQA the largest is tight
    lines = dict(choices(sweep(mha=25, gqa=50, mqa=45))[0].recommendations)
    assert lines["memory ample"].startswith("mha kv=8:") and lines["memory tight"].startswith("gqa kv=2:")
    # a tie in max batch goes to more KV heads
    tie = recommend({"gqa kv=2": {"max_batch": 8, "kv_heads": 2}, "mqa kv=1": {"max_batch": 8, "kv_heads": 1}}, None)
    assert dict(tie)["memory tight"].startswith("gqa kv=2:")
    assert set(RULES) == {scenario for scenario, _ in tie}


def test_quality_and_multiturn_come_from_records_when_present():
    records = sweep()
    for i, (kind, kv, ppl) in enumerate([("mha", 8, 5.0), ("gqa", 2, 5.2)]):
        records.append({"job": str(10 + i), "status": "ok", "config": {"task": "eval", "attention": {
            "type": kind, "num_kv_heads": kv}}, "metrics": {"perplexity": ppl}})
    for i, (shared, ttft) in enumerate([(False, 40.0), (True, 10.0)]):
        records.append({"job": str(20 + i), "status": "ok", "config": {
            "task": "bench", "attention": {"type": "mqa", "num_kv_heads": 1}, "workload": {"name": "multiturn"},
            "cache": {"shared": shared}}, "metrics": {"mean_ttft_ms_turns_2_n": ttft}})
    (choice,) = choices(records)
    rows = {r[0]: dict(zip(choice.header, r)) for r in choice.rows}
    # each cell names the job of the variant's own model it comes from
    assert rows["gqa kv=2"]["perplexity"] == "5.200 (task=eval, job 11)" and rows["mqa kv=1"]["perplexity"] == "-"
    assert dict(choice.recommendations)["multi-turn"] == (
        "mqa kv=1 with cache.shared=true: mean TTFT of turns 2-N 10.00 ms vs 40.00 ms unshared (0.250×)")


def test_failed_variant_is_a_note_and_no_capacity_no_table():
    records = sweep()
    records[0] = {**records[0], "status": "oom"}
    (choice,) = choices(records)
    assert [r[0] for r in choice.rows] == ["gqa kv=2", "mqa kv=1"]
    assert "mha kv=8: oom (job 0)" in choice.notes
    assert any("no MHA job" in n for n in choice.notes)
    assert choices([{"job": "0", "status": "ok", "config": {"task": "bench"}, "metrics": {}}]) == []


def test_console_report_and_plot(tmp_path):
    records = sweep()
    console = Console(width=250, record=True)
    for table in sweep_tables("sweep", records):
        console.print(table)
    text = console.export_text()
    assert "which attention to deploy" in text and "memory tight: mqa kv=1" in text
    data = capacity_panels(records, [], "max_batch")
    assert data == {"": {"mha kv=8": [(128, 20), (256, 10)], "gqa kv=2": [(128, 60), (256, 30)],
                         "mqa kv=1": [(128, 80), (256, 40)]}}
    assert capacity_panels(records, [], "predicted_max_batch")[""]["mha kv=8"] == [(128, 21), (256, 11)]
    drawn, skipped = draw_all(records, [], tmp_path)
    assert [p.name for p in drawn] == ["capacity_vs_context.png"] and "capacity_vs_context" not in skipped
    for i, rec in enumerate(records):
        from kvbench.results import RunResult

        RunResult(status="ok", config=rec["config"], metrics=rec["metrics"], tables=rec["tables"]).write(
            tmp_path / str(i))
    report = write_report(tmp_path)
    md = (tmp_path / "summary.md").read_text()
    assert "## Which attention to deploy" in md and "- **memory ample**: gqa kv=2" in md
    assert "![capacity_vs_context](capacity_vs_context.png)" in md
    assert len(report.records) == 3


def chat_record(job, kind, kv, shared, conversations, stopped="memory"):
    rec = capacity_record(job, kind, kv, {239: conversations}, {239: conversations}, 4096 // (8 // kv))
    rec["config"]["workload"] = {"name": "multiturn", "system_len": 192, "turns": 2, "user_len": 16, "reply_len": 8}
    rec["config"]["cache"] = {"shared": shared}
    rec["metrics"]["stopped_by_longest"] = stopped
    rec["tables"]["capacity"][0].update(stopped_by=stopped, kv_bytes_per_sequence=1000 * kv)
    return rec


def test_multi_turn_line_and_table_come_from_chat_capacity_jobs():
    records = sweep() + [chat_record(10, "mha", 8, False, 6), chat_record(11, "mha", 8, True, 20),
                         chat_record(12, "mqa", 1, False, 30),
                         chat_record(13, "mqa", 1, True, 32, "capacity.max_batch")]
    (choice,) = choices(records)
    # the decode table is unchanged by the chat jobs (same variants, decode numbers)
    assert [r[0] for r in choice.rows] == ["mha kv=8", "gqa kv=2", "mqa kv=1"]
    assert dict(zip(choice.header, choice.rows[0]))["max batch"] == "10"
    chat = [dict(zip(choice.chat_header, r)) for r in choice.chat_rows]
    assert [(r["variant"], r["cache.shared"], r["max conversations"]) for r in chat] == [
        ("mha kv=8", "false", "6"), ("mha kv=8", "true", "20"), ("mqa kv=1", "false", "30"), ("mqa kv=1", "true", "32")]
    assert chat[3]["stopped by"] == "capacity.max_batch" and chat[0]["positions / conversation"] == "239"
    assert dict(choice.recommendations)["multi-turn"] == (
        "mqa kv=1 with cache.shared=true: the most concurrent conversations, 32 vs 30 with cache.shared=false")
    # other numbers, other answer: unshared MQA holding more conversations wins, and says so
    records[-1] = chat_record(13, "mqa", 1, True, 25)
    assert dict(choices(records)[0].recommendations)["multi-turn"].startswith(
        "mqa kv=1 with cache.shared=false: the most concurrent conversations, 30 vs 25 with cache.shared=true")
    # the plot's points are the decode jobs' only (a chat's conversations are not a batch at a context)
    assert set(capacity_panels(records, [], "max_batch")[""]) == {"mha kv=8", "gqa kv=2", "mqa kv=1"}
    assert all(c != 239 for points in capacity_panels(records, [], "max_batch")[""].values() for c, _ in points)


def test_pooled_quality_columns_from_the_capacity_records():
    records = sweep()
    for rec, (kl, top1) in zip(records, [(0.0, 1.0), (0.0123, 0.9), (0.05, 0.75)]):
        rec["metrics"].update(kv_pool_kl_nats=kl, kv_pool_top1_agreement=top1)
    (choice,) = choices(records)
    rows = {r[0]: dict(zip(choice.header, r)) for r in choice.rows}
    assert rows["gqa kv=2"]["quality: KL vs MHA, nats (pooled)"] == "0.0123"
    assert rows["mqa kv=1"]["top-1 = MHA (pooled)"] == "0.750" and rows["mha kv=8"]["top-1 = MHA (pooled)"] == "1.000"
    assert any(n.startswith("quality (pooled): the MHA model of the same weights") for n in choice.notes)
    assert [rows[label]["quality source"] for label in rows] == ["pooled"] * 3  # records before quality_source


def test_no_quality_cell_shows_a_figure_measured_on_another_layout():
    """issue 59: the GDN hybrid showed GQA-2's pooled figures. A record that says what its figure was
    measured on is shown with that source; one that says none, none with its reason; an older record's
    figure only where pooling makes the variant (not a recurrent layer, not MLA, no layer option)."""
    records = sweep()
    old_gdn = capacity_record(3, "gqa", 2, {128: 50, 256: 45}, {128: 52, 256: 46}, 1536)
    old_gdn["config"]["attention"]["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
    mla = capacity_record(4, "mla", 1, {128: 20, 256: 10}, {128: 20, 256: 10}, 1000)
    mla["config"]["attention"]["kv_lora_rank"] = 16
    for rec in (*records, old_gdn, mla):
        rec["metrics"].update(kv_pool_kl_nats=0.0052, kv_pool_top1_agreement=0.795)  # GQA-2's, everywhere
    records[1]["metrics"]["quality_source"] = "pooled, not uptrained: the checkpoint's K/V heads mean-pooled"
    records[2]["metrics"].update(kv_pool_kl_nats=None, kv_pool_top1_agreement=None, quality_source=None,
                                 quality_none_reason="the variant's Gated DeltaNet layers 0 are not what pooling makes")
    (choice,) = choices([*records, old_gdn, mla])
    rows = {r[0]: dict(zip(choice.header, r)) for r in choice.rows}
    cells = {label: (r["quality: KL vs MHA, nats (pooled)"], r["quality source"]) for label, r in rows.items()}
    assert cells == {"mha kv=8": ("0.0052", "pooled"), "gqa kv=2": ("0.0052", "pooled, not uptrained"),
                     "mqa kv=1": ("-", "none"), "gqa kv=2 gdn 3:1": ("-", "none"), "mla r=16": ("-", "none")}
    assert any(n.startswith("quality of mqa kv=1: none pooled (the variant's Gated DeltaNet layers 0")
               for n in choice.notes)
    assert any(n.startswith("quality of gqa kv=2 gdn 3:1: none pooled (a record before issue 59") for n in choice.notes)


def test_recall_is_the_quality_column_when_recall_records_are_there():
    recall = [{"job": f"r{kv}", "status": "ok",
               "config": {"task": "recall", "attention": {"type": t, "num_kv_heads": kv}},
               "metrics": {"accuracy": acc, "accuracy_ci_low": acc - 0.01, "accuracy_ci_high": acc + 0.01}}
              for t, kv, acc in (("mha", 8, 0.99), ("mqa", 1, 0.5))]
    (choice,) = choices(sweep() + recall)
    rows = {r[0]: dict(zip(choice.header, r)) for r in choice.rows}
    assert rows["mha kv=8"]["recall accuracy [95%]"] == "0.990 [0.980, 1.000]"
    assert rows["mqa kv=1"]["recall accuracy [95%]"] == "0.500 [0.490, 0.510]"
    assert rows["gqa kv=2"]["recall accuracy [95%]"] == "-"  # no recall job of that variant
    assert "recall accuracy [95%]" not in choices(sweep())[0].header


def test_mla_and_a_hybrid_are_rows_of_the_same_table_not_tables_of_their_own():
    """A variant's latent rank and window are fields of the variant, not cells of the sweep: one
    table lists all five layouts (before: one table per value of attention.window)."""
    mla = capacity_record(3, "mla", 1, {128: 90, 256: 45}, {128: 90, 256: 45}, 288, 1.8)
    mla["config"]["attention"]["kv_lora_rank"] = 32
    hybrid = capacity_record(4, "gqa", 2, {128: 70, 256: 50}, {128: 70, 256: 50}, 1024, 1.5)
    hybrid["config"]["attention"].update(window=64, global_every=4)
    # 8 layers of 128 B a position: 2 global hold all 256 + 8 positions, 6 local a ring of 64
    hybrid["tables"]["capacity"][-1]["kv_bytes_per_sequence"] = (2 * 264 + 6 * 64) * 128
    (choice,) = choices([*sweep(), mla, hybrid])
    rows = {r[0]: dict(zip(choice.header, r)) for r in choice.rows}
    assert list(rows) == ["mha kv=8", "gqa kv=2", "gqa kv=2 w=64 3:1", "mqa kv=1", "mla r=32"]
    assert rows["mla r=32"]["max batch"] == "45" and rows["mla r=32"]["vs MHA"] == f"{288 / 4096:.3f}"
    # the hybrid's bytes per position at 256 + 8 positions, not the full-context 1024 B
    assert rows["gqa kv=2 w=64 3:1"]["vs MHA"] == f"{(2 * 264 + 6 * 64) * 128 / 264 / 4096:.3f}"
    # a record from before kv_bytes_per_token stated its length: the same definition from its longest row
    assert any(n.startswith("KV / token (at longest): one sequence's KV cache at the longest context") and
               "for gqa kv=2 w=64 3:1 it falls as the context grows" in n for n in choice.notes)
    assert choice.cell == ""
    lines = dict(choice.recommendations)
    # as many KV heads as the hybrid, and every layer sees the whole context: GQA is the ample choice
    assert lines["memory ample"].startswith("gqa kv=2:") and lines["memory tight"].startswith("gqa kv=2 w=64 3:1:")
    [note] = [n for n in choice.notes if n.startswith("memory ample counts KV heads")]
    assert "gqa kv=2 w=64 3:1, mla r=32" in note


def test_a_window_that_no_layer_applies_is_read_as_the_whole_context():
    """attention.global_every=1 makes every layer global: the variant keeps its W in the label
    (``w=64 0:1``) but every layer attends over the whole context, as the comparison and the plots
    read it too, so its KV / token is any one position's and KV heads rank it."""
    records = sweep()
    every_global = capacity_record(3, "gqa", 2, {128: 60, 256: 30}, {128: 60, 256: 30}, 1024, 1.5)
    every_global["config"]["attention"].update(window=64, global_every=1)
    every_global["tables"]["capacity"][-1]["kv_bytes_per_sequence"] = 4 * 264 * 128 + 1  # not read
    windowed = capacity_record(4, "gqa", 2, {128: 70, 256: 50}, {128: 70, 256: 50}, 1024, 1.5)
    windowed["config"]["attention"].update(window=64)
    windowed["tables"]["capacity"][-1]["kv_bytes_per_sequence"] = 64 * 1024
    (choice,) = choices([*records, every_global, windowed])
    rows = {r[0]: dict(zip(choice.header, r)) for r in choice.rows}
    assert list(rows) == ["mha kv=8", "gqa kv=2", "gqa kv=2 w=64 0:1", "gqa kv=2 w=64", "mqa kv=1"]
    assert rows["gqa kv=2 w=64 0:1"]["KV / token (at longest)"] == "1.00 KiB"
    [falls] = [n for n in choice.notes if n.startswith("KV / token (at longest):")]
    assert "for gqa kv=2 w=64 it falls as the context grows" in falls
    [unranked] = [n for n in choice.notes if n.startswith("memory ample counts KV heads")]
    assert "cannot rank gqa kv=2 w=64 (MLA caches" in unranked


def test_a_gated_deltanet_hybrid_is_a_row_with_its_state_and_the_batch_per_context():
    """experiment=choose's GDN hybrid: its per-sequence state in a column of its own (the K/V layouts
    0 B), the note that its KV / token carries the state over the positions, not ranked by KV
    heads, and the max batch at every context in a table (the state bounds short contexts)."""
    records = sweep()
    gdn = capacity_record(3, "gqa", 2, {128: 50, 256: 45}, {128: 52, 256: 46}, 1536)
    gdn["config"]["attention"]["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
    gdn["metrics"]["kv_state_bytes_per_sequence"] = 135_168
    gdn["tables"]["capacity"][0]["stopped_by"] = "tpot"
    records.append(gdn)
    for rec in records[:3]:
        rec["metrics"]["kv_state_bytes_per_sequence"] = 0
    (choice,) = choices(records)
    rows = {r[0]: dict(zip(choice.header, r)) for r in choice.rows}
    assert rows["gqa kv=2 gdn 3:1"]["state / sequence"] == "132.00 KiB"
    assert rows["gqa kv=2"]["state / sequence"] == "0 B"
    assert rows["gqa kv=2 gdn 3:1"]["KV / token (at longest)"] == "1.50 KiB"
    assert dict(choice.recommendations)["memory tight"].startswith("gqa kv=2 gdn 3:1: the largest max batch, 45")
    assert any(n.startswith("state / sequence: what a sequence of gqa kv=2 gdn 3:1 holds whatever its length")
               for n in choice.notes)
    assert any("cannot rank gqa kv=2 gdn 3:1" in n for n in choice.notes)
    assert choice.context_header == ["variant", "max batch @128", "max batch @256"]
    assert dict((r[0], r[1:]) for r in choice.context_rows)["gqa kv=2 gdn 3:1"] == ["50 (tpot)", "45 (-)"]
    # records without the state (older ones, K/V layouts only): no column
    (old,) = choices(sweep())
    assert "state / sequence" not in old.header


def test_an_untested_tpot_bound_is_not_a_number_and_a_capacity_that_falls_and_rises_is_flagged():
    """issue 59: MHA's 14 / 3 / 3 / 4 at 32-256 tokens, each bound by TPOT, moved with the machine: a
    capacity whose paired steps leave the verdict to chance reads 'untested' (and is not ranked), and one
    that falls and then rises with the context, where the bytes only grow, is flagged."""
    records = sweep()
    mha = capacity_record(0, "mha", 8, {32: 14, 64: 3, 128: 3, 256: 4}, {32: 40, 64: 30, 128: 20, 256: 10}, 4096,
                          stopped="tpot")
    mha["tables"]["capacity"][-1]["tpot_untested"] = "batch 5: paired TPOT ratio 2.01, 95% [1.80, 2.30] around 2"
    (choice,) = choices([mha, *records[1:]])
    rows = {r[0]: dict(zip(choice.header, r)) for r in choice.rows}
    assert rows["mha kv=8"]["max batch"] == "untested (tpot)"
    assert any(n.startswith("max batch of mha kv=8: untested, not a number") for n in choice.notes)
    assert not dict(choice.recommendations)["memory tight"].startswith("mha")
    context = {r[0]: r[1:] for r in choice.context_rows}
    assert "mha kv=8 (falls and rises with context: noise)" in context
    assert context["mha kv=8 (falls and rises with context: noise)"][-1] == "untested (tpot)"
    assert "gqa kv=2" in context  # 60, 30: falls only
