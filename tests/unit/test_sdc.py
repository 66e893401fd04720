"""Silent data corruption (issue 69, steadfast.sdc): the fingerprint finds every flipped
bit and every swap, covers a state of any size chunk by chunk; a check is judged (the
odd one out, the pair); the worker's probe publishes into a real heartbeat table; the
launcher's board finds the mismatch on one node and across two through a real TCPStore,
and writes one verdict; the ledger charges the culprit's node."""

from __future__ import annotations

import itertools
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from steadfast.events import read_events
from steadfast.ledger.records import faults_of_verdict
from steadfast.monitor.table import HeartbeatTable
from steadfast.sdc import Verdict, flip_bit, judge, layout
from steadfast.sdc.board import BoardState, ReplicaBoard, RoundLink
from steadfast.sdc.fingerprint import ReplicaState, Span, cpu_crc, device_hash, group_key
from steadfast.sdc.probe import ReplicaProbe
from steadfast.sdc.verdict import gathered_verdict


def _span(tensors: list[torch.Tensor]) -> Span:
    total = sum(t.numel() * t.element_size() for t in tensors)
    return Span(0, 1, 0, total, total)


@pytest.mark.parametrize("bit", [0, 7, 22, 23, 30, 31])
def test_every_single_bit_flip_changes_both_fingerprints(bit: int):
    t = torch.randn(1000)
    before = (cpu_crc([t], _span([t])), int(device_hash([t], _span([t]))))
    flip_bit(t, 123, bit)
    after = (cpu_crc([t], _span([t])), int(device_hash([t], _span([t]))))
    assert before[0] != after[0] and before[1] != after[1]
    flip_bit(t, 123, bit)  # flipped back: the same fingerprints again
    assert (cpu_crc([t], _span([t])), int(device_hash([t], _span([t])))) == before


def test_a_swap_or_a_permutation_changes_the_fingerprint_a_sum_would_keep():
    t = torch.randn(64)
    swapped = t.clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    rolled = torch.roll(t, 1)
    for other in (swapped, rolled):
        assert cpu_crc([t], _span([t])) != cpu_crc([other], _span([other]))
        assert int(device_hash([t], _span([t]))) != int(device_hash([other], _span([other])))
    a, b = torch.randn(8), torch.randn(8)  # the same values, in the other tensor order
    assert cpu_crc([a, b], _span([a, b])) != cpu_crc([b, a], _span([b, a]))


def test_a_large_state_is_covered_once_by_as_many_checks_as_it_has_chunks():
    model = torch.nn.Sequential(torch.nn.Linear(100, 70), torch.nn.Linear(70, 3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 100)).sum().backward()
    opt.step()
    state = ReplicaState(model, opt, budget=4096)
    tensors = state.tensors()
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert len(tensors) == 4 + 4 * 3  # 4 parameters, each with step, exp_avg, exp_avg_sq
    spans = [state.span(check, tensors) for check in range(state.span(0, tensors).chunks)]
    assert spans[0].start == 0 and spans[-1].end == total
    assert all(a.end == b.start for a, b in itertools.pairwise(spans))
    # a flip anywhere shows in exactly one chunk's fingerprint
    before = [cpu_crc(tensors, s) for s in spans]
    flip_bit(opt.state[model[1].weight]["exp_avg_sq"], 50, 22)
    after = [cpu_crc(tensors, s) for s in spans]
    assert sum(x != y for x, y in zip(before, after, strict=True)) == 1


def test_a_check_is_judged_the_odd_one_out_or_the_pair():
    assert judge({0: 7, 1: 7, 2: 7}).agreed
    odd = judge({0: 7, 1: 7, 2: 9, 3: 7})
    assert (odd.agreed, odd.culprits, odd.how) == (False, (2,), "odd_one_out")
    pair = judge({0: 7, 1: 9})
    assert (pair.culprits, pair.how) == ((0, 1), "pair")
    split = judge({0: 7, 1: 7, 2: 9, 3: 9})  # no strict majority: all in doubt
    assert (split.culprits, split.how) == ((0, 1, 2, 3), "pair")


def test_the_ring_reads_back_what_was_published_and_drops_what_was_overwritten():
    slots = [0.0] * 256
    slots[layout.GROUP] = float(group_key([0, 1, 2]))
    for n in range(1, 31):
        layout.publish(slots, n, layout.Entry(10 * n, 0, 1000 + n, 10 * n - 1))
    group, entries = layout.read(slots)
    assert group >> 32 == 3
    # 16 kept; the oldest may be under the next write
    assert [e.count for e in entries] == [10 * n for n in range(16, 31)]
    layout.clear(slots)
    assert layout.read(slots) == (0, [])


def test_the_probe_publishes_every_nth_step_of_the_optimizer_that_steps_the_model():
    slots = [0.0] * 256
    model = torch.nn.Linear(8, 2)
    opt, other = torch.optim.Adam(model.parameters()), torch.optim.SGD([torch.zeros(1)])
    probe = ReplicaProbe(slots, model, group_key([0, 1]), every=3, budget=1 << 20)
    for _step in range(9):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        probe.after_step(other, None)  # not this model's optimizer: not counted
        probe.after_step(opt, 100)
    group, entries = layout.read(slots)
    assert group == group_key([0, 1])
    assert [(e.count, e.step) for e in entries] == [(3, 102), (6, 105), (9, 108)]
    tensors = ReplicaState(model, opt).tensors()
    assert entries[-1].fp == cpu_crc(tensors, _span(tensors))


def _table_with(fps: dict[int, list[int]], group: int) -> HeartbeatTable:
    """A heartbeat table whose rows published ``fps[local]``: check n after step 10n."""
    table = HeartbeatTable.create(rows=len(fps))
    for local, values in fps.items():
        slots, _ = table.progress_area(local)
        slots[layout.GROUP] = float(group)
        for n, fp in enumerate(values, start=1):
            layout.publish(slots, n, layout.Entry(10 * n, 0, fp, 10 * n - 1))
    return table


def test_the_board_names_the_odd_one_out_on_one_node(event_log: Path):
    table = _table_with({0: [5, 6, 7], 1: [5, 6, 7], 2: [5, 9, 9]}, group_key([0, 1, 2]))
    board = ReplicaBoard(table, "node-a", interval=0.05)
    try:
        board.watch({0: 0, 1: 1, 2: 2}, None)
        verdict = board.poll(5.0)
        assert verdict == Verdict((2,), "odd_one_out", ("node-a",), (2,), 3, 9, 19, 10)
        assert board.state is BoardState.DISAGREED
        board.unwatch()
    finally:
        board.close()
        table.close()
    evs = list(read_events(event_log))
    (seen,) = [e for e in evs if e.kind == "sdc_detected"]
    assert seen.step == 19 and seen.fields["fingerprints"] == {"0": 6, "1": 6, "2": 9}
    (said,) = [e for e in evs if e.kind == "sdc_verdict"]
    assert said.fields["culprits"] == [2] and said.fields["last_agreed_step"] == 9
    (checked,) = [e for e in evs if e.kind == "replicas_checked"]
    assert checked.fields["checks"] == 1 and checked.fields["last_agreed_step"] == 9


def test_replicas_that_agree_give_no_verdict(event_log: Path):
    table = _table_with({0: [5, 6, 7], 1: [5, 6, 7]}, group_key([0, 1]))
    board = ReplicaBoard(table, "node-a", interval=0.05)
    try:
        board.watch({0: 0, 1: 1}, None)
        assert board.poll(0.5) is None
        board.unwatch()
    finally:
        board.close()
        table.close()
    kinds = [e.kind for e in read_events(event_log)]
    assert "sdc_detected" not in kinds and kinds.count("replicas_checked") == 1


def test_two_nodes_compare_through_the_store_and_agree_on_one_verdict(event_log: Path):
    from torch.distributed import TCPStore

    group = group_key([0, 1, 2, 3])
    server = TCPStore(
        "127.0.0.1", 0, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    client = TCPStore("127.0.0.1", server.port, 2, False, timeout=timedelta(seconds=10))
    tables = [
        _table_with({0: [5, 6, 7], 1: [5, 6, 7]}, group),  # node 0: ranks 0, 1
        _table_with({0: [5, 6, 7], 1: [5, 6, 8]}, group),  # node 1: ranks 2, 3 (3 flips)
    ]
    boards = [ReplicaBoard(t, f"node-{i}", interval=0.05, store_interval=0.05) for i, t in
              enumerate(tables)]  # fmt: skip
    try:
        for node, (board, store) in enumerate(zip(boards, (server, client), strict=True)):
            ranks = {local: 2 * node + local for local in range(2)}
            board.watch(ranks, RoundLink(store, "steadfast/", node, 2))
        verdicts = [board.poll(10.0) for board in boards]
        claims = int(server.add("steadfast/sdc/claim", 0))
    finally:
        for board in boards:
            board.close()
        for table in tables:
            table.close()
        del boards, server, client  # their sockets with them
    expected = Verdict((3,), "odd_one_out", ("node-1",), (1,), 4, 19, 29, 20)
    assert verdicts[0] == verdicts[1] == expected
    assert claims >= 1
    said = [e for e in read_events(event_log) if e.kind == "sdc_verdict"]
    assert len(said) == 1  # one node claimed it


def test_a_verdict_waits_for_the_replicas_that_did_not_publish_the_check():
    group = group_key([0, 1, 2])

    def rank(local: int, fp: int) -> dict[str, object]:
        return {"g": group, "local": local, "e": [[10, 0, 5, 9], [20, 0, fp, 19]]}

    nodes = [{"host": "a", "ranks": {"0": rank(0, 6), "1": rank(1, 7)}}]
    assert gathered_verdict(nodes, group, 20, None) is None  # rank 2 has not said yet
    pair = gathered_verdict(nodes, group, 20, None, complete=True)
    assert pair is not None and pair.how == "pair" and pair.culprits == (0, 1)
    assert pair.last_agreed_step is None  # two of three agreeing proves nothing
    assert pair.first_bad_step == 19
    assert Verdict.from_json(pair.to_json()) == pair


def test_the_ledger_charges_each_culprits_node():
    record = {"kind": "sdc_verdict", "time": 1.0, "cause": "odd_one_out", "culprits": [3],
              "hosts": ["n1"], "replicas": 4, "first_bad_step": 29}  # fmt: skip
    (fault,) = faults_of_verdict(record, "job")
    assert (fault.node, fault.cause) == ("n1", "silent_corruption")
    pair = {**record, "cause": "pair", "culprits": [0, 1], "hosts": ["n0", "n0"]}
    assert [f.cause for f in faults_of_verdict(pair, "job")] == ["silent_corruption_pair"]
    assert json.dumps([f.node for f in faults_of_verdict(pair, "job")]) == '["n0"]'
