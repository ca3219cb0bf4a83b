"""Careless and hostile conversation files and settings for ``workload=conversations``: each bad row
of a ShareGPT JSON or of a CSV / JSONL of turns is one line naming the key, the file, the line and
the field; a bad setting is one line naming its key; a CLI run of either exits 2 with that line
before anything is built. Files that are fine (a byte-order mark, a spaced header, system messages,
interleaved conversations) are read as they are meant."""

import json
import os

import pytest
from conftest import compose, kvbench_forked

from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.serving.conversation_traces import read_sharegpt, read_turns
from kvbench.serving.conversations import make_chats
from kvbench.tasks import bench
from kvbench.workloads.serving import check_requests

CONV = ["workload=conversations", "model=tiny", "runtime.isolate=false", "wandb=disabled", "runtime.threads=1"]


def one_line_error(fn, *args):
    with pytest.raises(ConfigError) as err:
        fn(*args)
    line = str(err.value)
    assert "\n" not in line
    return line


def chat(*messages):
    return {"conversations": [{"from": f, "value": v} for f, v in messages]}


GOOD = chat(("human", "hi"), ("gpt", "hello there"))


# ---- ShareGPT: each bad conversation is one line naming the file, its line and the field -----------

@pytest.mark.parametrize("doc, needle", [
    ([GOOD, {"conversation": []}], "line 3 (conversation 1): conversations: a list of messages is expected, got None"),
    ([GOOD, ["human", "hi"]], "line 3 (conversation 1): conversations: a list of messages is expected"),
    ([GOOD, {"conversations": "hi"}], "line 3 (conversation 1): conversations: a list of messages is expected, "
                                      "got 'hi'"),
    ([GOOD, {"conversations": ["hi"]}], "line 3 (conversation 1): conversations[0]: an object with from and value"),
    ([GOOD, chat(("human", "hi"), ("gpt", 3))], "line 3 (conversation 1): conversations[1].value=3: a string"),
    ([GOOD, chat(("human", "hi"), ("robot", "x"))], "line 3 (conversation 1): conversations[1].from='robot': gpt "
                                                    "expected"),
    ([GOOD, chat(("gpt", "hi"), ("human", "x"))], "line 3 (conversation 1): conversations[0].from='gpt': human "
                                                  "expected"),
    ([GOOD, chat(("human", "a"), ("human", "b"))], "conversations[1].from='human': gpt expected"),
    ([GOOD, chat(("human", "a"), ("gpt", "b"), ("system", "c"))], "conversations[2].from='system': human expected"),
    ([GOOD, chat(("human", ""), ("gpt", "b"))], "conversations[0].value='': a message of no tokens"),
    ([GOOD, chat(("human", "a"), ("gpt", ""))], "conversations[1].value='': an answer of no tokens"),
    ([GOOD, chat(("human", "a"))], "line 3 (conversation 1): conversations: no human message with a gpt answer"),
    ([GOOD, {"conversations": [{"from": None, "value": "a"}]}], "conversations[0].from=None: human expected"),
])
def test_a_bad_sharegpt_conversation_is_one_line_naming_file_line_and_field(tmp_path, doc, needle):
    path = tmp_path / "chats.json"
    path.write_text("[\n" + ",\n".join(json.dumps(d) for d in doc) + "\n]\n")
    line = one_line_error(read_sharegpt, str(path))
    assert line.startswith(f"workload.sharegpt='{path}': "), line
    assert needle in line, line


@pytest.mark.parametrize("text, needle", [
    ("", "line 1: a JSON list of conversations is expected"),
    ('{"conversations": []}', "line 1: a JSON list of conversations is expected"),
    ("[]", "holds no conversations"),
    ('[\n{"conversations": [}\n]', "line 2: not JSON"),
    ('[\n{"conversations": []} {"x": 1}\n]', "line 2: ',' or ']' expected after a conversation"),
    (f"[\n{json.dumps(GOOD)}\n]\n]", "line 4: text after the list"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply to parse"),
])
def test_a_sharegpt_file_that_breaks_the_parser_is_one_short_line(tmp_path, text, needle):
    path = tmp_path / "chats.json"
    path.write_text(text)
    line = one_line_error(read_sharegpt, str(path))
    assert needle in line and len(line) < 300, line


def test_a_missing_or_binary_sharegpt_file_is_one_line(tmp_path):
    assert one_line_error(read_sharegpt, str(tmp_path / "none.json")).endswith(": no such file or directory")
    (tmp_path / "bin.json").write_bytes(b"[\xff\xfe]")
    assert "not UTF-8 text" in one_line_error(read_sharegpt, str(tmp_path / "bin.json"))


@pytest.mark.parametrize("reader, key", [(read_sharegpt, "workload.sharegpt"), (read_turns, "workload.trace")])
def test_a_path_that_is_no_file_says_what_it_is(tmp_path, reader, key):
    """Each said "no such file", whatever was there: a directory, a link whose target is gone."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "gone.json").symlink_to(tmp_path / "deleted.json")
    (tmp_path / "a-file").write_text("[]")
    os.mkfifo(tmp_path / "fifo")
    cases = {"folder": "a directory, not a file", "gone.json": f"a link to {tmp_path / 'deleted.json'}, "
             "which does not exist", "missing.json": "no such file or directory",
             "a-file/x.json": "no such file or directory (a parent of it is a file)",
             "fifo": "a FIFO, not a regular file"}
    for name, why in cases.items():
        path = str(tmp_path / name)
        assert one_line_error(reader, path) == f"{key}={path!r}: {why}"


def test_sharegpt_turns_are_human_messages_and_their_answers_in_utf8_bytes(tmp_path):
    path = tmp_path / "chats.json"
    doc = [chat(("system", "be brief"), ("human", "héllo"), ("gpt", "hi"), ("human", "more"), ("gpt", "ok!"),
                ("human", "never answered")),
           {"conversations": [{"from": "user", "value": "x"}, {"from": "assistant", "value": "yz"}], "id": "a"}]
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(doc, indent=1).encode())  # a byte-order mark, indented
    chats = read_sharegpt(str(path))
    assert [[(t.user_len, t.output_len) for t in c] for c in chats] == [[(8 + 6, 2), (4, 3)], [(1, 2)]]
    assert chats[0][0].text == "be brief".encode() + "héllo".encode()  # the system message opens the first turn


# ---- a CSV / JSONL of turns -----------------------------------------------------------------------

HEADER = "conversation,turn,arrival_s,user_len,output_len,think_s\n"


@pytest.mark.parametrize("rows, needle", [
    ("a,0,0.0,8,4,\na,2,,8,4,\n", "line 3: turn=2: conversation 'a' expects turn 1 next"),
    ("a,1,0.0,8,4,\n", "line 2: turn=1: conversation 'a' expects turn 0 next"),
    ("a,0,0.0,8,4,\na,0,1.0,8,4,\n", "line 3: turn=0: conversation 'a' expects turn 1 next"),
    ("a,0,,8,4,\n", "line 2: no arrival_s"),
    ("a,0,0.0,0,4,\n", "line 2: user_len='0' must be >= 1"),
    ("a,0,0.0,8,-4,\n", "line 2: output_len='-4' must be >= 1"),
    ("a,0,0.0,8.5,4,\n", "line 2: user_len='8.5' is not an integer"),
    ("a,0,nan,8,4,\n", "line 2: arrival_s='nan' must be finite"),
    ("a,0,1e9,8,4,\n", "line 2: arrival_s='1e9' is 1.16e+04 days, more than the 24 h"),
    ("a,0,0.0,8,4,-1\n", "line 2: think_s='-1' must be >= 0"),
    ("a,0,0.0,8,4,\n,1,,8,4,\n", "line 3: no conversation"),
    ("a,zero,0.0,8,4,\n", "line 2: turn='zero' is not an integer"),
])
def test_a_bad_csv_turn_is_one_line_naming_file_line_and_field(tmp_path, rows, needle):
    path = tmp_path / "turns.csv"
    path.write_text(HEADER + rows)
    line = one_line_error(read_turns, str(path))
    assert line.startswith(f"workload.trace='{path}': "), line
    assert needle in line, line


@pytest.mark.parametrize("lines, needle", [
    (['{"conversation": 1, "turn": 0, "arrival_s": 0, "user_len": 8, "output_len": 4}', "[1, 2]"],
     "line 2: a JSON object is expected, got list"),
    (['{"conversation": 1, "turn": 0, "arrival_s": true, "user_len": 8, "output_len": 4}'],
     "line 1: arrival_s=True is not a number"),
    (['{"conversation": {"a": 1}, "turn": 0, "arrival_s": 0, "user_len": 8, "output_len": 4}'],
     "line 1: conversation={'a': 1}: an id (a number or a name) is expected"),
    (['{"conversation": 1, "turn": 0, "arrival_s": 0, "user_len": 8, "output_len": 4}', '{"conversation": 1,'],
     "line 2: not JSON"),
])
def test_a_bad_jsonl_turn_is_one_line_naming_file_line_and_field(tmp_path, lines, needle):
    path = tmp_path / "turns.jsonl"
    path.write_text("\n".join(lines) + "\n")
    line = one_line_error(read_turns, str(path))
    assert line.startswith(f"workload.trace='{path}': ") and needle in line, line


def test_a_csv_without_a_column_is_one_line_naming_it(tmp_path):
    path = tmp_path / "turns.csv"
    path.write_text("conversation,turn,user_len,output_len\na,0,8,4\n")
    assert "the header lacks arrival_s" in one_line_error(read_turns, str(path))


def test_interleaved_conversations_with_a_spaced_header_and_a_bom_are_read(tmp_path):
    path = tmp_path / "turns.csv"
    path.write_bytes(b"\xef\xbb\xbfconversation, turn, arrival_s, user_len, output_len, think_s\n"
                     b"a,0,0.5,8,4,\nb,0,0.2,6,3,\na,1,,5,2,1.5\nb,1,3.0,7,2,\n")
    chats = read_turns(str(path))
    assert [[(t.user_len, t.output_len, t.think_s, t.arrival_s) for t in c] for c in chats] == [
        [(8, 4, 0.0, 0.5), (5, 2, 1.5, None)], [(6, 3, 0.0, 0.2), (7, 2, 0.0, 3.0)]]


# ---- settings: one line naming the key -----------------------------------------------------------

def refusal(*overrides):
    with pytest.raises(ConfigError) as err:
        check_requests(to_bench_config(compose(*CONV, *overrides)))
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("overrides, start", [
    (["workload.think.mean=-1"], "workload.think.mean=-1.0: must be >= 0 seconds"),
    (["workload.think.dist=gaussian"], "workload.think.dist='gaussian': must be one of"),
    (["workload.think.dist=uniform", "workload.think.lo=5", "workload.think.hi=1"], "workload.think.hi=1.0: must be"),
    (["workload.think.mean=1e9"], "workload.think.mean=1000000000.0: must be <= 86400"),
    (["workload.turns.lo=0"], "workload.turns.lo=0: must be >= 1"),
    (["workload.num_requests=3000"], "workload.num_requests=3000: 4 turns a conversation on average, ~1.2e+04 "),
    (["workload.arrival=trace", "workload.trace=x.csv", "workload.sharegpt=y.json"], "workload.sharegpt='y.json': "
                                                                                     "workload.arrival=trace reads"),
    (["workload.arrival=trace", "workload.trace=x.csv", "workload.prefix_len=8"], "workload.prefix_len=8: a "
                                                                                  "conversation trace has no system"),
    (["model.max_seq_len=512"], "workload.prompt=LengthConfig(dist='lognormal', mean=64.0, cv=0.5, lo=8, hi=256): "
                                "the workload needs 1824 positions"),
    (["workload.kv_budget_mb=0.1"], "workload.kv_budget_mb=0.1: holds 6 blocks"),
])
def test_a_bad_conversation_setting_is_one_line_naming_its_key(overrides, start):
    line = refusal(*overrides)
    assert line.startswith(start), line


def test_a_sharegpt_file_with_fewer_conversations_than_arrive_is_one_line(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([GOOD, GOOD]))
    line = refusal(f"workload.sharegpt={path}", "workload.num_requests=3")
    assert line == f"workload.num_requests=3: 3 conversations arrive, workload.sharegpt='{path}' holds 2; lower it"
    cfg = to_bench_config(compose(*CONV, f"workload.sharegpt={path}", "workload.num_requests=2"))
    plan = make_chats(cfg.workload, cfg.model.vocab_size).plan()
    assert [(r.conversation, r.turn, r.prompt_len, r.output_len) for r in plan.requests] == [
        (0, 0, 2, 11), (1, 0, 2, 11)]
    assert plan.prompts == [list(b"hi"), list(b"hi")]  # the bytes are the ids (tiny's vocabulary: 256)


def test_a_file_conversation_longer_than_the_model_is_one_line_naming_its_turn(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([GOOD, chat(("human", "a" * 30), ("gpt", "b" * 20), ("human", "c" * 30), ("gpt", "d"))]))
    line = refusal(f"workload.sharegpt={path}", "workload.num_requests=2", "model.max_seq_len=64")
    assert line == ("workload.sharegpt: conversation 1's turn 1 (its whole history) needs 80 + 1 positions, more than "
                    "model.max_seq_len=64")


def test_a_bad_trace_row_is_invalid_before_the_model_is_built_or_progress_shown(tmp_path, monkeypatch):
    path = tmp_path / "turns.csv"
    path.write_text(HEADER + "a,0,0.0,8,4,\na,1,,8,x,\n")
    shown, built = [], []
    monkeypatch.setattr(bench, "build_model", lambda *a, **k: built.append(1))
    record = run_job(compose(*CONV, "workload.arrival=trace", f"workload.trace={path}"), tmp_path / "run",
                     progress=lambda label, total: shown.append(label))
    assert record.status == "invalid" and shown == [] and built == []
    assert record.error == f"workload.trace='{path}': line 3: output_len='x' is not an integer"


@pytest.mark.e2e
def test_the_cli_exits_2_with_one_line_for_a_bad_conversation_file(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text("[\n" + json.dumps(GOOD) + ",\n" + json.dumps(chat(("robot", "x"))) + "\n]\n")
    [proc] = kvbench_forked([(["model=tiny", "workload=conversations", f"workload.sharegpt={path}",
                               "runtime.threads=1", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"kvbench: invalid config: workload.sharegpt='{path}': line 3 (conversation 1): "
                           "conversations[0].from='robot': human expected"), line


@pytest.mark.e2e
def test_the_cli_names_a_directory_given_as_the_sharegpt_file(tmp_path):
    [proc] = kvbench_forked([(["model=tiny", "workload=conversations", f"workload.sharegpt={tmp_path}",
                               "runtime.threads=1", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"kvbench: invalid config: workload.sharegpt='{tmp_path}': a directory, not a file "), line


def test_a_tokenizer_that_does_not_parse_or_gives_no_tokens_is_one_line(tmp_path):
    """model.path's tokenizer.json tokenizes workload.sharegpt's text: one that does not parse is one
    line naming the file; a message it turns into no tokens is refused as an empty one is."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kvbench.serving.tokenize import checkpoint_encoder

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    line = one_line_error(checkpoint_encoder, str(tmp_path / "bad"))
    assert str(tmp_path / "bad" / "tokenizer.json") in line and "not a readable tokenizer" in line, line
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "good").mkdir()
    tok.save(str(tmp_path / "good" / "tokenizer.json"))
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([chat(("human", "hi"), ("gpt", "hi")), chat(("human", "  "), ("gpt", "hi"))]))
    line = one_line_error(read_sharegpt, str(path), checkpoint_encoder(str(tmp_path / "good")))
    # the value in one line: whitespace runs as one space
    assert "line 1 (conversation 1): conversations[0].value=' ': a message of no tokens" in line, line
