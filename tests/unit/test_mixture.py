"""Mixtures of data sources (`training.dataset_mix`): the entries, the schedule's proportions and
layout independence, each source's own data order, exact resume mid-mixture across dp degrees.

    pytest tests/unit/test_mixture.py
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Training
from torchmoe.data import ByteTokenizer, DataLoader, InMemoryDocuments, build_dataloader
from torchmoe.data.mixture import MixSchedule, parse_mix

G = 8


def test_entries_name_weight_dataset_and_path() -> None:
    web, code, hub = parse_mix(["web=0.7:local:data/web/*.jsonl", "2:tokens:/d/code", "c4=1e-1:hf:allenai/c4:en"])
    assert (web.name, web.weight, web.dataset, web.dataset_path) == ("web", 0.7, "local", "data/web/*.jsonl")
    assert (code.name, code.weight, code.dataset, code.dataset_path) == ("source1", 2.0, "tokens", "/d/code")
    assert (hub.name, hub.dataset, hub.dataset_path) == ("c4", "hf", "allenai/c4:en")  # the hub config kept
    assert parse_mix(["1:local:a=b.txt"])[0].dataset_path == "a=b.txt"  # "=" in a path is not a name


@pytest.mark.parametrize("entries, problem", [
    (["0.7"], "is not of the form"),
    (["web=x:local:a.txt"], "'x' is not a weight"),
    (["web=0:local:a.txt"], "the weight 0 is not a positive number"),
    (["web=-1:local:a.txt"], "the weight -1 is not a positive number"),
    (["web=nan:local:a.txt"], "the weight nan is not a positive number"),
    (["a b=1:local:a.txt"], "is not of the form"),
    (["w=1:local:a.txt", "w=2:local:b.txt"], "a second source named 'w'"),
])
def test_bad_entries_are_one_message(entries: list[str], problem: str) -> None:
    with pytest.raises(ConfigError, match="training.dataset_mix = ") as err:
        parse_mix(entries)
    assert problem in str(err.value)


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.2, 0.1], [1, 2, 3, 4], [0.99, 0.01]])
@pytest.mark.parametrize("seed", [0, 1, 1234])
def test_proportions_within_1_percent_over_10k_rows(weights: list[float], seed: int) -> None:
    schedule = MixSchedule(weights, seed)
    picks = np.concatenate([schedule.sources(step, range(G), G) for step in range(10_000 // G)])
    assert len(picks) == 10_000
    share = np.bincount(picks, minlength=len(weights)) / len(picks)
    assert np.abs(share - np.array(weights) / sum(weights)).max() < 0.01, share
    # Also over any window of 1,000 rows: the sequence does not drift.
    for start in range(0, 9_000, 1_000):
        window = np.bincount(picks[start:start + 1_000], minlength=len(weights)) / 1_000
        assert np.abs(window - np.array(weights) / sum(weights)).max() < 0.01, (start, window)


@pytest.mark.parametrize("weights", [[1e308, 1e308], [1.5e308, 0.5e308, 1e308], [5e-324, 1e-323]])
def test_weights_at_the_ends_of_the_float_range_keep_their_shares(weights: list[float]) -> None:
    """Weights whose sum overflows (1e308 + 1e308 = inf sent every row to the last source) or that
    are subnormal: the shares are still the weights' proportions."""
    schedule = MixSchedule(weights, seed=0)
    picks = np.concatenate([schedule.sources(step, range(G), G) for step in range(4_000 // G)])
    expected = {2: [0.5, 0.5], 3: [0.5, 1 / 6, 1 / 3]}[len(weights)] if weights[0] > 1 else [1 / 3, 2 / 3]
    share = np.bincount(picks, minlength=len(weights)) / len(picks)
    assert np.abs(share - np.array(expected)).max() < 0.01, share


def test_schedule_depends_on_step_row_and_seed_only() -> None:
    schedule = MixSchedule([0.6, 0.4], seed=3)
    for step in (0, 7, 10**6):
        whole = schedule.sources(step, range(G), G)
        assert np.array_equal(np.concatenate([schedule.sources(step, range(r, r + 2), G) for r in range(0, G, 2)]),
                              whole)  # any split of the rows over ranks
        assert np.array_equal(schedule.counts(step, G), np.bincount(whole, minlength=2))
    other = MixSchedule([0.6, 0.4], seed=4)
    steps = range(50)
    assert any(not np.array_equal(schedule.sources(s, range(G), G), other.sources(s, range(G), G)) for s in steps)


def _corpora() -> list[InMemoryDocuments]:
    return [InMemoryDocuments([f"{tag}{i}:" + tag * (i * 7 % 41) for i in range(40)]) for tag in "abc"]


def _mixed(dp_degree: int = 1, dp_rank: int = 0, local_batch_size: int = G, seed: int = 0) -> DataLoader:
    return DataLoader(_corpora(), ByteTokenizer(), seq_len=8, global_batch_size=G, local_batch_size=local_batch_size,
                      dp_rank=dp_rank, dp_degree=dp_degree, mix=MixSchedule([0.5, 0.3, 0.2], seed),
                      source_names=["a", "b", "c"])


def _step(ranks: list[DataLoader]) -> torch.Tensor:
    return torch.cat([x for rank in ranks for x, _ in rank.next_batch()])


def test_each_source_keeps_its_own_order() -> None:
    """Row j's windows from source s, in order, are the windows row j of s alone would give."""
    mixed = _mixed()
    alone = [DataLoader(c, ByteTokenizer(), seq_len=8, global_batch_size=G, local_batch_size=G) for c in _corpora()]
    schedule = MixSchedule([0.5, 0.3, 0.2], 0)
    got: dict[tuple[int, int], list[list[int]]] = {}
    for step in range(30):
        batch = _step([mixed]).tolist()
        for row, source in enumerate(schedule.sources(step, range(G), G).tolist()):
            got.setdefault((source, row), []).append(batch[row])
    for s, loader in enumerate(alone):
        windows = [_step([loader]).tolist() for _ in range(30)]
        for row in range(G):
            drawn = got.get((s, row), [])
            assert drawn == [w[row] for w in windows[:len(drawn)]], (s, row)
    counts = {name: n // 8 for name, n in mixed.tokens_by_source().items()}
    assert sum(counts.values()) == 30 * G
    assert counts == {"abc"[s]: sum(len(v) for (src, _), v in got.items() if src == s) for s in range(3)}


@pytest.mark.parametrize("saved, resumed", [((1, G), (2, 4)), ((2, 2), (4, 1)), ((4, 2), (1, 4))])
def test_resume_mid_mixture_is_exact_across_dp_degrees(saved: tuple[int, int], resumed: tuple[int, int]) -> None:
    first = [_mixed(saved[0], r, saved[1]) for r in range(saved[0])]
    for _ in range(13):
        _step(first)
    states = [rank.state_dict() for rank in first]
    state = {"step": 13, "rows": torch.cat([s["rows"] for s in states]), "source_rows": states[0]["source_rows"]}
    assert state["rows"].shape == (G, 9)
    again = [_mixed(resumed[0], r, resumed[1]) for r in range(resumed[0])]
    for rank in again:
        rank.load_state_dict(state)
    for _ in range(20):
        assert torch.equal(_step(again), _step(first))
    assert again[0].tokens_by_source() == first[0].tokens_by_source()


def test_a_checkpoint_of_other_sources_is_one_message() -> None:
    single = DataLoader(_corpora()[0], ByteTokenizer(), seq_len=8, global_batch_size=G, local_batch_size=G)
    single.next_batch()
    with pytest.raises(ConfigError, match=r"training.dataset_mix = 3: the checkpoint was saved with 1 data source\(s\), "
                                          r"this run has 3"):
        _mixed().load_state_dict(single.state_dict())
    with pytest.raises(ConfigError, match="saved with 3 data source"):
        single.check_saved_shapes({"rows": torch.Size((G, 9)), "split": torch.Size(())})


def test_build_dataloader_reads_every_source(tmp_path) -> None:
    for tag in "xy":
        (tmp_path / f"{tag}.txt").write_text("".join(f"{tag * 3} line {i}\n" for i in range(500)))
    training = Training(dataset_mix=[f"x=3:local:{tmp_path}/x.txt", f"y=1:local:{tmp_path}/y.txt"], seq_len=16,
                        local_batch_size=G, seed=5)
    loader = build_dataloader(training, ByteTokenizer())
    rows = torch.cat([_step([loader]) for _ in range(100)])
    text = [bytes(t for t in row if t < 256) for row in rows.tolist()]  # without EOS
    from_x = sum(1 for row in text if row.count(b"x") > row.count(b"y"))
    assert abs(from_x / len(rows) - 0.75) < 0.01
    assert loader.tokens_by_source() == {"x": from_x * 16, "y": (len(rows) - from_x) * 16}
    single = build_dataloader(dataclasses.replace(training, dataset_mix=[f"x=3:local:{tmp_path}/x.txt"]),
                              ByteTokenizer())
    assert "source_rows" not in single.state_dict()  # one source: the state of a plain run


def test_a_mixture_checkpoint_saved_before_source_ids_still_resumes() -> None:
    """Its files lack `source_ids`: not asked of DCP (a missing key would fail the load), taken
    as it is, and saved from the next checkpoint on."""
    first = _mixed()
    for _ in range(3):
        _step([first])
    old = {k: v for k, v in first.state_dict().items() if k != "source_ids"}
    again = _mixed()
    again.check_saved_shapes({k: v.shape for k, v in old.items() if isinstance(v, torch.Tensor)})
    assert "source_ids" not in again.state_dict()
    again.load_state_dict(old)
    assert torch.equal(_step([again]), _step([first])) and "source_ids" in again.state_dict()
    renamed = DataLoader(_corpora(), ByteTokenizer(), seq_len=8, global_batch_size=G, local_batch_size=G,
                         mix=MixSchedule([0.5, 0.3, 0.2], 0), source_names=["a", "c", "b"])
    with pytest.raises(ConfigError, match=r"saved with other sources at position 1 \(c\), 2 \(b\)"):
        renamed.load_state_dict(first.state_dict())
