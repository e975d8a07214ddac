"""A step is one state in every group, whatever a partition does (``fault_tolerance``, with and without
``replica_sync``): the decisions of :mod:`lightning_smp.fault_tolerance.agreement` (leave a crossing the peers left,
the commit fence, the comparison where groups meet) as pure functions and over real process groups, and the races
forced in real runs on loopback: a group frozen inside a crossing for longer than the heartbeat timeout, whose side
of the crossing then completes after its peer abandoned it (without the fence it committed the step the peer had
dropped, and the same step stood for two states); two groups that meet at the same step holding different states."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_smp.fault_tolerance.agreement import (
    InCrossing,
    abandon_reason,
    compare_at_meeting,
    counters_of,
    fence_reason,
    lineage,
    quick_fingerprint,
)
from lightning_smp.fault_tolerance.crossing import LighthouseView
from lightning_smp.testing import run_distributed

REPO = Path(__file__).resolve().parents[1]
FABRIC_SCRIPT = [str(REPO / "benchmarks" / "fault_run.py")]
TRAINER_SCRIPT = [str(REPO / "tests" / "scripts" / "ft_trainer.py")]
HEARTBEAT = 2.0

torchft = pytest.importorskip("torchft")

A, B = "group0000:a", "group0001:b"


def _view(quorum: int | None = 3, pending: int = 0, heard: dict[str, bool] | None = None) -> LighthouseView:
    return LighthouseView({A: True, B: True} if heard is None else heard, quorum, pending)


@pytest.mark.parametrize(("view", "crossing", "expected"), [
    pytest.param(None, InCrossing(3, (A, B)), None, id="unread_no_verdict"),
    pytest.param(_view(), InCrossing(3, (A, B)), None, id="all_heard_same_quorum"),
    pytest.param(_view(heard={A: True, B: False}), InCrossing(3, (A, B)), "stopped hearing from group0001",
                 id="participant_old"),
    pytest.param(_view(heard={A: True}), InCrossing(3, (A, B)), "stopped hearing from group0001", id="not_listed"),
    pytest.param(_view(quorum=4), InCrossing(3, (A, B)), "formed quorum 4 after this crossing's quorum 3",
                 id="peers_moved_on"),
    pytest.param(_view(pending=1), InCrossing(3, (A, B)), None, id="asked_once"),
    pytest.param(_view(pending=1), InCrossing(3, (A, B), asked_for=0.2), None, id="asked_briefly"),
    pytest.param(_view(pending=1), InCrossing(3, (A, B), asked_for=0.5), "a peer left this crossing",
                 id="asked_for_half_a_second"),
    pytest.param(_view(pending=1), InCrossing(3, (A, B), lost=True), "it had lost the lighthouse",
                 id="asked_after_a_cut"),
    pytest.param(_view(), InCrossing(3, (A, B), lost=True, asked_for=1.0), None, id="lost_but_nobody_asks"),
])
def test_a_crossing_is_left_when_its_peers_left_it(view, crossing, expected):
    reason = abandon_reason(view, crossing)
    assert (reason is None) if expected is None else (expected in reason), reason


@pytest.mark.parametrize(("view", "asking_is_leaving", "expected"), [
    pytest.param(_view(), False, None, id="same_quorum_all_heard"),
    pytest.param(None, False, "could not be read", id="unread_drops"),
    pytest.param(_view(quorum=4), False, "formed quorum 4 after this step's quorum 3", id="moved_on"),
    pytest.param(_view(quorum=None), False, "formed quorum None", id="no_quorum_on_the_page"),
    pytest.param(_view(heard={A: True, B: False}), False, "stopped hearing from group0001", id="participant_old"),
    pytest.param(_view(pending=1), False, None, id="a_fast_peer_asks_next"),
    pytest.param(_view(pending=1), True, "a peer refused it", id="sync_refused_by_a_peer"),
])
def test_the_fence_lets_a_step_commit_only_in_the_quorum_it_crossed_in(view, asking_is_leaving, expected):
    reason = fence_reason(view, 3, [A, B], asking_is_leaving=asking_is_leaving)
    assert (reason is None) if expected is None else (expected in reason), reason


def test_the_lineage_prefers_the_newest_quorum_then_the_lowest_group():
    assert lineage(7, 5) > lineage(6, 0)  # (moved on last: kept, whatever its id)
    assert lineage(7, 0) > lineage(7, 1)  # (equals: the lowest group id)
    assert lineage(-1, 0) > 0


def test_the_meeting_fingerprint_sees_any_value_and_the_counters():
    tensors = [torch.arange(6.0), torch.ones(2, 2)]
    same = quick_fingerprint(tensors, ["step=3"])
    assert quick_fingerprint([t.clone() for t in tensors], ["step=3"]) == same
    assert quick_fingerprint([tensors[0], tensors[1] + 1e-3], ["step=3"]) != same  # (an XOR alone: the same)
    # (values that only moved are not seen: a step moves none, it changes them; the start's fingerprint sees them)
    assert quick_fingerprint([tensors[0].flip(0), tensors[1]], ["step=3"]) == same
    assert quick_fingerprint(tensors, ["step=4"]) != same
    assert 0 <= same < 1 << 62
    state = {"loops": {"global_step": 3, "batch": [1, 2]}, "lr": 0.1, "t": torch.ones(2)}
    assert counters_of(state) == ["/loops/batch/0=1", "/loops/batch/1=2", "/loops/global_step=3", "/lr=0.1"]


def _meet(rank: int, world: int, fingerprints: list, keys: list, fail: int | None) -> str:
    """This rank as one group of a meeting (the world's ranks are the groups, one rank each); ``fail``: the rank
    whose side of the all-reduce reports a failure."""

    def all_reduce_max(tensor: torch.Tensor) -> bool:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return rank != fail

    return compare_at_meeting(fingerprints[rank], keys[rank], device=torch.device("cpu"),
                              all_reduce_max=all_reduce_max, agree=lambda flags: flags).value


@pytest.mark.parametrize(("fingerprints", "keys", "expected"), [
    pytest.param([5, 5, 5], [lineage(2, 0), lineage(2, 1), lineage(2, 2)], ["same"] * 3, id="same"),
    pytest.param([5, 6, 5], [lineage(2, 0), lineage(2, 1), lineage(2, 2)], ["keeps", "heals", "heals"],
                 id="differ_tie_lowest_group"),
    pytest.param([5, 6, 6], [lineage(2, 0), lineage(4, 1), lineage(4, 2)], ["heals", "keeps", "heals"],
                 id="differ_the_group_that_moved_on_last"),
    pytest.param([5, None, 5], [lineage(2, 0), lineage(9, 1), lineage(2, 2)], ["same"] * 3,
                 id="a_group_behind_heals_and_does_not_compare"),
    pytest.param([5, None, 6], [lineage(2, 0), lineage(9, 1), lineage(2, 2)], ["keeps", "heals", "heals"],
                 id="behind_and_differ_heals_again_from_the_one_kept"),
])
def test_groups_that_meet_holding_different_states_take_one_deterministically(fingerprints, keys, expected):
    assert run_distributed(_meet, 3, fingerprints, keys, None) == expected


def test_a_meeting_whose_collective_failed_is_dropped():
    assert run_distributed(_meet, 2, [5, 6], [lineage(1, 0), lineage(1, 1)], 0)[0] == "failed"


def _watch_a_quorum(rank: int, world: int) -> list:
    from torchft._torchft import LighthouseClient

    from lightning_smp.fault_tolerance.crossing import LighthouseWatch
    from lightning_smp.fault_tolerance.lighthouse import start_lighthouse

    lighthouse = start_lighthouse("127.0.0.1:0", min_groups=2, heartbeat_timeout=5.0)
    try:
        client = LighthouseClient(lighthouse.address, timedelta(seconds=5))
        watch = LighthouseWatch(lighthouse.address)
        client.heartbeat(A)
        client.heartbeat(B)
        before = watch.view()
        import threading

        asked = threading.Thread(target=client.quorum, kwargs={
            "replica_id": A, "timeout": timedelta(seconds=10), "address": "a", "store_address": "s", "step": 1,
            "world_size": 1, "shrink_only": False})
        asked.start()
        time.sleep(0.5)
        waiting = watch.view()  # (A asked; B heartbeats but has not: the next quorum waits for it)
        client.quorum(replica_id=B, timeout=timedelta(seconds=10), address="b", store_address="s", step=1,
                      world_size=1, shrink_only=False)
        asked.join()
        formed = watch.view()
    finally:
        lighthouse.shutdown()
    return [(v.quorum_id, v.pending, v.silent([A, B])) for v in (before, waiting, formed)]


@pytest.mark.timeout(60)
def test_the_watch_reads_the_last_quorum_and_who_asks_for_the_next():
    """The lighthouse's own status page (torchft 0.2.0's): the id of the quorum it formed last (0 before any), the
    groups that asked for the next one, and who it hears from. (In a forked process: torchft's runtime threads must
    not run in the one the other tests fork their ranks from.)"""
    assert run_distributed(_watch_a_quorum, 1)[0] == [(0, 0, []), (0, 1, []), (1, 0, [])]


def _heal_held_by_the_peer(rank: int, world: int, hold: str | None) -> list:
    """A heal from a peer that holds it (``hold``): before it answers (``"answer"``), or once the answer and a
    kilobyte of the state have gone (``"body"``), as a cut link holds a transfer; the verdict says the peers moved on
    once the peer holds it. The heal is left, and its transfer cut short at once (its thread ends while the peer still
    holds it: its bytes would otherwise go on crossing the link when it comes back, beside the next heal's). With
    ``hold=None``, a peer that stages its state at the verdict's first read, and a verdict that never says leave: the
    state arrives."""
    import socket
    import threading
    from datetime import timedelta

    from lightning_smp.errors import FaultToleranceError
    from lightning_smp.fault_tolerance.transport import bound_http_transport

    ours = bound_http_transport(timedelta(seconds=30), "127.0.0.1", grace=0.0, every=0.01)
    holding, release = threading.Event(), threading.Event()
    if hold is None:
        peer = bound_http_transport(timedelta(seconds=30), "127.0.0.1")
        address = peer.metadata()
    else:
        import io

        from torchft.checkpointing._serialization import _streaming_save

        saved = io.BytesIO()
        _streaming_save({"w": torch.zeros(1 << 20)}, saved)
        stream = saved.getvalue()
        listener = socket.create_server(("127.0.0.1", 0))

        def serve() -> None:
            connection, _ = listener.accept()
            with connection:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += connection.recv(4096)
                if hold == "body":  # (the answer, and the first kilobyte of a state of 4 MB)
                    connection.sendall(b"HTTP/1.0 200 OK\r\nContent-type: application/octet-stream\r\n\r\n"
                                       + stream[:1024])
                holding.set()
                release.wait(30)

        threading.Thread(target=serve, daemon=True).start()
        address = f"http://127.0.0.1:{listener.getsockname()[1]}/checkpoint/"
    reads: list[int] = []

    def verdict() -> str | None:
        reads.append(len(reads))
        if hold is None and len(reads) == 1:
            peer.send_checkpoint(dst_ranks=[1], step=7, state_dict={"w": torch.arange(4.0)},
                                 timeout=timedelta(seconds=30))
        return "the peers moved on" if holding.is_set() else None

    ours.verdict = lambda: verdict
    try:
        received = ours.recv_checkpoint(src_rank=0, metadata=address, step=7, timeout=timedelta(seconds=30))
        return ["received", received["w"].tolist(), ours.received_seconds is not None]
    except FaultToleranceError as err:
        fetching = [thread for thread in threading.enumerate() if thread.name == "lightning_smp-heal"]
        for thread in fetching:
            thread.join(timeout=20)
        return ["left", str(err).split(", ", 1)[1], ours.received_seconds, [t.name for t in fetching if t.is_alive()]]
    finally:
        release.set()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hold", ["answer", "body"])
def test_a_heal_is_left_when_the_peers_moved_on_and_its_transfer_cut_short(hold):
    assert run_distributed(_heal_held_by_the_peer, 1, hold)[0] == ["left", "the peers moved on", None, []]


@pytest.mark.timeout(60)
def test_a_heal_that_nothing_leaves_receives_the_peer_s_state():
    assert run_distributed(_heal_held_by_the_peer, 1, None)[0] == ["received", [0.0, 1.0, 2.0, 3.0], True]


def _serve_through_a_stalled_transfer(rank: int, world: int) -> list:
    """A peer's healing transfer stalls (it reads the first kilobyte of a 64 MB state and no more, as across a cut
    link): the serving rank's next commit (torchft's ``disallow_checkpoint``) does not wait for it, training writes
    its parameters, and the stalled transfer, once read on, brings the state as it was staged."""
    import http.client
    import io
    from datetime import timedelta

    from torchft.checkpointing._serialization import _streaming_load

    from lightning_smp.fault_tolerance.transport import bound_http_transport

    source = bound_http_transport(timedelta(seconds=3), "127.0.0.1")
    live = torch.arange(16 * 1024 * 1024, dtype=torch.float32)
    source.send_checkpoint(dst_ranks=[1], step=4, state_dict={"w": live}, timeout=timedelta(seconds=3))
    live.add_(1.0)  # (training moves on after staging: the state served is the one staged)
    port = source._server.socket.getsockname()[1]
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/checkpoint/4/full")
    response = connection.getresponse()
    head = response.read(1024)  # (then nothing: the server's writes fill the socket's buffers and block)
    try:
        source.disallow_checkpoint()  # (torchft's lock: before, this waited for the stalled transfer, then failed)
        committed = "committed"
    except TimeoutError as err:
        committed = f"waited: {err}"
    live.add_(1.0)  # (the optimizer step)
    try:
        received = _streaming_load(io.BytesIO(head + response.read()), weights_only=False)["w"]
    except Exception as err:  # noqa: BLE001  # (a transfer cut short)
        return [committed, f"not received: {err}"]
    return [committed, bool(torch.equal(received, torch.arange(16 * 1024 * 1024, dtype=torch.float32)))]


@pytest.mark.timeout(60)
def test_a_stalled_healing_transfer_never_holds_the_serving_group_back():
    assert run_distributed(_serve_through_a_stalled_transfer, 1)[0] == ["committed", True]


# ------------------------------------------------------------------------------------ the races, forced


def _jobs(tmp_path: Path, script: list[str], **kwargs):
    from lightning_smp.testing.replica_groups import ReplicaGroupJobs

    return ReplicaGroupJobs(script, tmp_path / "run", heartbeat_timeout=HEARTBEAT, **kwargs)


def _digests(jobs, group: int, rank: int, key: str, by: str = "step", since: int = 0) -> dict[int, str]:
    """Group ``group``'s rank ``rank``'s ``key`` digest at each ``by`` it recorded from committed step ``since`` on (a
    step recorded with two different digests is marked: the group held two states of it)."""
    seen: dict[int, list[str]] = {}
    for record in jobs.records(group, rank):
        if record["step"] >= since:
            seen.setdefault(record[by], []).append(record[key])
    return {step: values[-1] for step, values in seen.items() if len(set(values)) == 1} | {
        step: "twice:" + ",".join(values) for step, values in seen.items() if len(set(values)) > 1}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["steps", "syncs"])
def test_a_group_frozen_past_the_heartbeat_inside_a_crossing_never_commits_what_its_peer_dropped(tmp_path, mode):
    """Group 1 freezes (every process stopped, heartbeats too, no connection closed) inside a crossing after its 4th
    committed step (``steps``: a step's gradients, plain fault tolerance; ``syncs``: a sync's, ``replica_sync`` every
    4 steps) for twice the heartbeat timeout, then goes on: its side of that crossing completes (its peer's abandoned
    one is still alive in the background) after the survivor left it and went on without it. The survivor's longest
    wait is the heartbeat, never the collective's timeout; group 1 drops the step (the fence: its peers moved on), heals
    from the survivor, and every step both groups committed is the same state in both, on every rank. (The survivor's
    side as a node that lost power or its link: only the watch on the lighthouse ends its wait, within the
    heartbeat; it commits its next step alone, and finishes.)"""
    if mode == "steps":
        script, extra, key, by, steps = FABRIC_SCRIPT, ["--pause", "0.2"], "model", "step", 36
    else:  # (the outer loop's synced copies and momentum, at every inner step: equal after every sync both commit)
        script, extra, key, by, steps = TRAINER_SCRIPT, ["--every", "4", "--pause", "0.2"], "outer", "global_step", 48
    with _jobs(tmp_path, script) as jobs:
        for group in (0, 1):
            freeze = ["--vanish_at", "4", "--vanish", "stop", "--thaw_after", str(2 * HEARTBEAT)] if group == 1 else []
            jobs.start(group, "--steps", str(steps), *extra, *freeze)
        assert jobs.wait(240) == {0: 0, 1: 0}, jobs.logs()
        marker = json.loads((jobs.out / "vanished1").read_text())
        frozen = marker["time"]
        for rank in range(jobs.degree):
            # (from the step it froze in: before, with min_groups=1, a group that started first may have trained
            # alone, and the other joined it, as the kill-and-heal tests hold)
            ours, theirs = (_digests(jobs, group, rank, key, by, since=marker["step"]) for group in (0, 1))
            both = sorted(set(ours) & set(theirs))
            assert len(both) >= steps // 4, (rank, both)
            split = [s for s in both if ours[s] != theirs[s]]
            assert not split, (rank, split, jobs.logs())
            # the survivor waited a heartbeat at most (and a step), on each of its ranks, never the collective's
            # timeout (10 s), and committed its next step without group 1
            times = [r["time"] for r in jobs.records(0, rank) if r["time"] > frozen - 5]
            assert max(b - a for a, b in zip(times, times[1:])) <= HEARTBEAT + 3, times
            if mode == "steps":
                after = [r for r in jobs.records(0, rank) if r["time"] > frozen]
                assert after[0]["step"] == marker["step"] + 1 and after[0]["groups"] == 1, after[0]
        if mode == "syncs":  # (and every sync the survivor committed is in its logger: replica_sync/*)
            import csv

            path = next((jobs.out / "metrics" / "group0").glob("version_*/metrics.csv"))
            with path.open() as f:
                syncs = [float(row["replica_sync/syncs"]) for row in csv.DictReader(f) if row.get("replica_sync/syncs")]
            assert syncs == sorted(syncs) and len(syncs) >= steps // 4 - 2, syncs
        log1 = (jobs.out / "log1.txt").read_text()
        # (group 1 dropped the step it froze in: at the fence, when its side completed, or when the crossing failed)
        assert f"step {marker['step']} not committed" in log1, jobs.logs()
        survivor = (jobs.out / "log0.txt").read_text()
        assert "ran past its timeout" not in survivor + log1  # (left by the watch, never the clock)
        assert "abandoned: the lighthouse stopped hearing from group0001" in survivor, jobs.logs()
        assert max(r["step" if mode == "steps" else "global_step"] for r in jobs.records(0)) == steps  # (finished)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_groups_that_meet_at_the_same_step_holding_different_states_heal_from_one_and_say_so(tmp_path):
    """Group 1's weights move after its 4th committed step (as a split step leaves them: the same step, another
    state); its 5th step is refused in both groups after the crossing, so they meet again in a new quorum at the same
    step. There they compare fingerprints, find them different, drop that step, and group 1 (an equal lineage, the
    higher id) heals from group 0; both say so in their metrics and logs, and are bit-equal at every step from then
    on, on every rank."""
    import csv

    with _jobs(tmp_path, FABRIC_SCRIPT, min_groups=2) as jobs:
        jobs.start(0, "--steps", "10", "--refuse_at", "5", "--min_groups", "2")
        jobs.start(1, "--steps", "10", "--refuse_at", "5", "--perturb_at", "4", "--min_groups", "2")
        assert jobs.wait(200) == {0: 0, 1: 0}, jobs.logs()
        for rank in range(jobs.degree):
            ours, theirs = _digests(jobs, 0, rank, "model"), _digests(jobs, 1, rank, "model")
            assert [s for s in range(5, 11) if ours[s] != theirs[s]] == [], (rank, jobs.logs())
            assert any(r["healed_at"] is not None for r in jobs.records(1, rank))
        for group, part in ((0, "keeps its own"), (1, "takes the state of the group that moved on last")):
            assert f"holding different states: this group {part}" in (jobs.out / f"log{group}.txt").read_text()
            path = next((jobs.out / "metrics" / f"group{group}").glob("version_*/metrics.csv"))
            with path.open() as f:
                assert any(row.get("fault_tolerance/diverged") == "1.0" for row in csv.DictReader(f))


def _heals(jobs, group: int) -> list[dict]:
    path = jobs.out / f"heals{group}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_cut_off_as_it_heals_leaves_the_heal_and_never_stalls_the_survivor(tmp_path):
    """Group 1 joins a running group 0 and, as its heal begins, freezes (heartbeats too) for 1.5 x the heartbeat
    timeout, while group 0's healing server holds that first transfer for 6 x (a transfer stalled as TCP's
    retransmission backoff stalls it after a cut). The survivor leaves the meeting after the heartbeat and trains on
    alone; once group 1 is heard again the survivor's next quorum waits for it, and group 1, seeing that its peers
    moved on, leaves its heal at once instead of waiting out the stalled transfer (before, the survivor waited for
    it: 6 x the heartbeat). Group 1 then heals at its next quorum, and every step both groups record from then on
    is the same state in both, on every rank."""
    with _jobs(tmp_path, FABRIC_SCRIPT) as jobs:
        jobs.start(0, "--steps", "60", "--pause", "0.2", "--slow_serving", str(6 * HEARTBEAT))
        jobs.wait_for(lambda: len(jobs.records(0)) >= 3, 120, "group 0 training")
        jobs.start(1, "--steps", "60", "--pause", "0.2", "--freeze_in_heal", str(1.5 * HEARTBEAT))
        assert jobs.wait(240) == {0: 0, 1: 0}, jobs.logs()
        heals = _heals(jobs, 1)
        assert len(heals) >= 2, heals  # (the heal left, and the one after it)
        frozen = heals[0]["time"]
        log1 = (jobs.out / "log1.txt").read_text()
        assert "the heal from a peer was left" in log1, jobs.logs()
        for rank in range(jobs.degree):
            times = [r["time"] for r in jobs.records(0, rank) if r["time"] > frozen - 5]
            assert max(b - a for a, b in zip(times, times[1:])) <= HEARTBEAT + 3, times
            healed = min(r["step"] for r in jobs.records(1, rank) if r["healed_at"] is not None)
            ours, theirs = (_digests(jobs, group, rank, "model", since=healed) for group in (0, 1))
            both = sorted(set(ours) & set(theirs))
            assert len(both) >= 10, (rank, both)
            assert [s for s in both if ours[s] != theirs[s]] == [], (rank, both, jobs.logs())
        assert "ran past its timeout" not in log1 + (jobs.out / "log0.txt").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_heal_that_reaches_only_some_ranks_of_a_group_is_taken_by_none(tmp_path):
    """Group 1 joins a running group 0, and its rank 1's first heal fails while its rank 0 receives its own: no rank
    takes its peer's state (a group half healed would train a mosaic of two states), the step is dropped, every rank
    stays behind, says so, and the group heals whole at its next quorum: every step both groups record is the same
    state in both, on every rank."""
    with _jobs(tmp_path, FABRIC_SCRIPT) as jobs:
        jobs.start(0, "--steps", "40", "--pause", "0.2")
        jobs.wait_for(lambda: len(jobs.records(0)) >= 3, 120, "group 0 training")
        jobs.start(1, "--steps", "40", "--pause", "0.2", "--fail_heal_rank", "1")
        assert jobs.wait(240) == {0: 0, 1: 0}, jobs.logs()
        assert "a peer's state did not reach every rank of the group; none takes it" in (
            jobs.out / "log1.txt").read_text(), jobs.logs()
        assert len(_heals(jobs, 1)) >= 2
        for rank in range(jobs.degree):
            ours, theirs = (_digests(jobs, group, rank, "model") for group in (0, 1))
            both = sorted(set(ours) & set(theirs))
            assert len(both) >= 10 and [s for s in both if ours[s] != theirs[s]] == [], (rank, both, jobs.logs())
