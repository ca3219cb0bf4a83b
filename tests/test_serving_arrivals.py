"""The serving workload's arrival process against its own definitions: the gaps' mean and
dispersion within bounds derived from the sample size, the seed's determinism, lengths within
their bounds, shared prefixes, and trace files (with one-line errors naming the row)."""

import math

import numpy as np
import pytest

from kvbench.config.serving import LengthConfig, ServingWorkload
from kvbench.core.errors import ConfigError
from kvbench.serving.arrivals import draw_lengths, inter_arrivals, make_requests, read_trace, request_tokens

N = 20_000
Z = 5.0  # standard errors: a seeded draw this far out happens about once in 1.7 million


def serving(**kw) -> ServingWorkload:
    return ServingWorkload(kv_budget_mb=1.0, **kw)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_gaps_have_mean_one_over_rate_and_cv2_one_over_burstiness(burstiness):
    rate = 8.0
    gaps = inter_arrivals(np.random.default_rng(3), N, rate, burstiness)
    mean, sd = 1 / rate, 1 / (rate * math.sqrt(burstiness))  # gamma(k, 1/(k rate)): var = 1 / (k rate^2)
    assert abs(gaps.mean() - mean) <= Z * sd / math.sqrt(N)
    cv2 = gaps.var(ddof=1) / gaps.mean() ** 2
    # The relative standard error of the sample variance of a gamma(k) is sqrt((2 + 6/k) / n) (its
    # excess kurtosis is 6/k), the mean's squared adds at most 2/sqrt(k n): a bound on CV^2's.
    rel_se = math.sqrt((2 + 6 / burstiness) / N) + 2 / math.sqrt(burstiness * N)
    assert abs(cv2 - 1 / burstiness) <= Z * rel_se / burstiness


def test_requests_arrive_at_the_cumulative_gaps_and_the_same_seed_gives_the_same_requests():
    w = serving(num_requests=50, rate=2.0, arrival="gamma", burstiness=0.5, prefix_len=8, prefix_fraction=0.5)
    a, b = make_requests(w), make_requests(w)
    assert a == b
    assert [r.id for r in a] == list(range(50))
    times = [r.arrival_s for r in a]
    assert times == sorted(times) and times[0] > 0
    assert np.allclose(times, np.cumsum(inter_arrivals(np.random.default_rng(0), 50, 2.0, 0.5)))
    assert make_requests(serving(num_requests=50, rate=2.0, arrival="gamma", burstiness=0.5, seed=1)) != a
    assert [request_tokens(r, 97, 0) for r in a] == [request_tokens(r, 97, 0) for r in b]


@pytest.mark.parametrize("dist", [LengthConfig("fixed", 7), LengthConfig("uniform", 0, 0, 3, 9),
                                  LengthConfig("lognormal", 40, 1.5, 10, 60)])
def test_lengths_stay_within_their_bounds(dist):
    values = draw_lengths(np.random.default_rng(0), N, dist)
    if dist.dist == "fixed":
        assert set(values.tolist()) == {7}
    else:
        assert values.min() >= dist.lo and values.max() <= dist.hi
        assert values.min() == dist.lo and values.max() == dist.hi  # the ends are reached (clipped or drawn)


def test_lognormal_lengths_have_the_mean_and_cv_asked_for_when_nothing_is_clipped():
    mean, cv = 100.0, 0.5
    values = draw_lengths(np.random.default_rng(1), N, LengthConfig("lognormal", mean, cv, 1, 10**6))
    # rounding to integers moves the mean by at most 0.5
    assert abs(values.mean() - mean) <= Z * mean * cv / math.sqrt(N) + 0.5
    # the sample CV's relative standard error: half the variance's, sqrt((2 + excess kurtosis) / n), plus
    # the mean's, cv / sqrt(n); a lognormal's excess kurtosis is e^(4s2) + 2e^(3s2) + 3e^(2s2) - 6
    s2 = math.log1p(cv ** 2)
    kurtosis = math.exp(4 * s2) + 2 * math.exp(3 * s2) + 3 * math.exp(2 * s2) - 6
    rel_se = 0.5 * math.sqrt((2 + kurtosis) / N) + cv / math.sqrt(N)
    assert abs(values.std() / values.mean() - cv) <= Z * rel_se * cv


def test_duration_draws_every_arrival_up_to_it():
    w = serving(num_requests=None, duration_s=50.0, rate=20.0)
    times = [r.arrival_s for r in make_requests(w)]
    assert max(times) <= 50.0
    n, expected = len(times), 20.0 * 50.0  # Poisson count: sd = sqrt(expected)
    assert abs(n - expected) <= Z * math.sqrt(expected)


def test_a_prefix_is_shared_by_the_fraction_asked_and_its_tokens_are_the_same():
    w = serving(num_requests=2000, prefix_len=16, prefix_fraction=0.25, prefix_groups=3,
                prompt=LengthConfig("uniform", 0, 0, 4, 8))
    requests = make_requests(w)
    prefixed = [r for r in requests if r.prefix_id is not None]
    p, n = 0.25, len(requests)
    assert abs(len(prefixed) - p * n) <= Z * math.sqrt(n * p * (1 - p))
    assert {r.prefix_id for r in prefixed} == {0, 1, 2}
    for r in requests:
        own = r.prompt_len - r.prefix_len
        assert 4 <= own <= 8 and r.prefix_len == (16 if r.prefix_id is not None else 0)
    by_group = {}
    for r in prefixed:
        tokens = request_tokens(r, 97, 0)
        assert len(tokens) == r.prompt_len
        by_group.setdefault(r.prefix_id, set()).add(tuple(tokens[:16]))
    assert all(len(heads) == 1 for heads in by_group.values())
    assert len({next(iter(h)) for h in by_group.values()}) == 3


def test_a_trace_file_is_read_as_jsonl_or_csv(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"arrival_s": 0.0, "prompt_len": 10, "output_len": 3}\n\n'
                     '{"arrival_s": 0.5, "prompt_len": 20, "output_len": 4, "prefix_id": 2}\n')
    a = read_trace(str(jsonl), default_prefix_len=8)
    assert [(r.arrival_s, r.prompt_len, r.output_len, r.prefix_id, r.prefix_len) for r in a] == [
        (0.0, 10, 3, None, 0), (0.5, 20, 4, 2, 8)]
    csv_file = tmp_path / "t.csv"
    csv_file.write_text("arrival_s,prompt_len,output_len,prefix_id,prefix_len\n0,10,3,,\n0.5,20,4,2,8\n")
    assert read_trace(str(csv_file), default_prefix_len=8) == a
    assert make_requests(serving(arrival="trace", trace=str(csv_file), prefix_len=8)) == a


@pytest.mark.parametrize("text, where", [
    ('{"arrival_s": 1, "prompt_len": 10, "output_len": 3}\n{"arrival_s": 0.5, "prompt_len": 5, "output_len": 2}\n',
     "line 2: arrival_s=0.5 is before"),
    ('{"arrival_s": 0, "prompt_len": 10}\n', "line 1: no output_len"),
    ('{"arrival_s": 0, "prompt_len": "ten", "output_len": 3}\n', "line 1: prompt_len='ten' is not an integer"),
    ('{"arrival_s": 0, "prompt_len": 4, "output_len": 3, "prefix_id": 0, "prefix_len": 9}\n',
     "line 1: prefix_len=9 is longer than prompt_len=4"),
    ('{"arrival_s": 0, "prompt_len": 4, "output_len": 0}\n', "line 1: output_len=0 must be >= 1"),
    ('{"arrival_s": 0, "prompt_len": 4, "output_len": 1}\n{oops\n', "line 2: not JSON"),
    ("arrival_s,prompt_len\n0,4\n", "the header lacks output_len"),
    ("arrival_s,prompt_len,output_len\n0,4,2\nnan,4,2\n", "line 3: arrival_s='nan' must be finite"),
])
def test_a_bad_trace_is_one_line_naming_the_file_and_the_row(tmp_path, text, where):
    path = tmp_path / "bad.trace"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_trace(str(path))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"workload.trace={str(path)!r}") and where in message


def test_a_missing_trace_and_bad_serving_keys_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="workload.trace='/nonexistent.jsonl': no such file"):
        read_trace("/nonexistent.jsonl")
    bad = [(dict(rate=0.0), "workload.rate=0.0"), (dict(arrival="uniform"), "workload.arrival='uniform'"),
           (dict(burstiness=-1.0), "workload.burstiness=-1.0"), (dict(arrival="trace"), "workload.trace=None"),
           (dict(num_requests=None), "workload.num_requests=None"),
           (dict(prompt=LengthConfig("lognormal", 5, 0.5, 10, 20)), "workload.prompt.mean=5"),
           (dict(output=LengthConfig("uniform", 5, 0.5, 10, 2)), "workload.output.hi=2"),
           (dict(prompt=LengthConfig("zipf")), "workload.prompt.dist='zipf'"),
           (dict(prefix_fraction=1.5), "workload.prefix_fraction=1.5"),
           (dict(store="radix"), "workload.store='radix'"), (dict(kv_budget_blocks=4), "workload.kv_budget_mb=1.0")]
    for kw, key in bad:
        with pytest.raises(ConfigError) as err:
            serving(**kw)
        assert str(err.value).startswith(key), (kw, str(err.value))
