"""Affinity routing: rendezvous hashing of a key over replicas, with a load bound (pure), and how
ModelRuntime.pick_replica uses it."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import ready_runtime
from proxy.config.model import ModelConfig
from proxy.lifecycle.state import affinity
from proxy.lifecycle.state.affinity import Candidate, KeyTable, choose, order
from proxy.lifecycle.state.replicas import ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime

KEYS = st.text(min_size=1, max_size=40)
INDEXES = st.lists(st.integers(min_value=0, max_value=63), min_size=1, max_size=12, unique=True)

CONFIG = ModelConfig(name="m", backend="sim", enabled=True, replicas=3, replica_max=3, target_inflight=4,
                     modalities=("text",), gpus=(), options={"routing": "affinity", "affinity_prefix_chars": 1024})


def idle(indexes: list[int]) -> list[Candidate]:
    return [Candidate(i, 0.0, True) for i in indexes]


@given(KEYS, INDEXES)
def test_the_order_is_a_permutation_that_does_not_depend_on_how_replicas_are_listed(key: str,
                                                                                   indexes: list[int]) -> None:
    assert sorted(order(key, indexes)) == sorted(indexes)
    assert order(key, indexes) == order(key, list(reversed(indexes)))


def test_scores_are_the_same_in_every_process() -> None:
    # Pinned: blake2b, not Python's per-process salted hash(), so a restarted proxy (or a second one)
    # sends each key where it went before.
    assert affinity.score("conversation-1", 0) == 0x56F06B6583A2936A
    assert order("conversation-1", [0, 1, 2, 3, 4]) == [4, 1, 0, 2, 3]


@settings(max_examples=200)
@given(KEYS, INDEXES, st.data())
def test_a_replica_leaving_moves_only_its_own_keys(key: str, indexes: list[int], data: st.DataObject) -> None:
    gone = data.draw(st.sampled_from(indexes))
    before = choose(key, idle(indexes), 1.0)
    after = choose(key, idle([i for i in indexes if i != gone]), 1.0)
    assert before is not None
    if before.index != gone:
        assert after is not None and after.index == before.index
    elif after is not None:
        # Its keys go to their second choice, the same one every time.
        assert after.index == order(key, indexes)[1]


@settings(max_examples=200)
@given(KEYS, INDEXES, st.integers(min_value=64, max_value=80))
def test_a_replica_joining_takes_only_the_keys_it_now_tops(key: str, indexes: list[int], new: int) -> None:
    before = choose(key, idle(indexes), 1.0)
    after = choose(key, idle([*indexes, new]), 1.0)
    assert before is not None and after is not None
    assert after.index in (before.index, new)


def test_keys_spread_evenly_over_replicas() -> None:
    for n in (2, 3, 5):
        homes = Counter(order(f"conversation-{k}", list(range(n)))[0] for k in range(3000))
        assert set(homes) == set(range(n))
        assert max(homes.values()) < 1.2 * 3000 / n, homes    # within 20% of an even share


def test_removing_one_of_four_replicas_moves_about_a_quarter_of_the_keys() -> None:
    keys = [f"k{i}" for i in range(2000)]
    before = {k: order(k, [0, 1, 2, 3])[0] for k in keys}
    after = {k: order(k, [0, 1, 3])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == 2 for k in moved)
    assert len(moved) == sum(1 for k in keys if before[k] == 2)
    assert 0.18 < len(moved) / len(keys) < 0.32


def test_the_home_replica_is_taken_while_it_has_room_and_is_within_the_bound() -> None:
    home, second, third = order("chat", [0, 1, 2])
    loads = {home: 2.0, second: 1.0, third: 0.0}
    got = choose("chat", [Candidate(i, loads[i], True) for i in (0, 1, 2)], max_imbalance=2.0)
    assert got == affinity.Choice(index=home, home=home, spilled=False)


def test_a_full_home_replica_spills_to_the_next_in_the_keys_order() -> None:
    home, second, third = order("chat", [0, 1, 2])
    cands = [Candidate(home, 4.0, False), Candidate(second, 3.0, True), Candidate(third, 0.0, True)]
    assert choose("chat", cands, max_imbalance=4.0) == affinity.Choice(index=second, home=home, spilled=True, away=True)


def test_a_home_replica_busier_than_the_bound_spills() -> None:
    home, second, third = order("chat", [0, 1, 2])
    loads = {home: 3.0, second: 2.5, third: 0.0}
    got = choose("chat", [Candidate(i, loads[i], True) for i in (0, 1, 2)], max_imbalance=2.0)
    assert got is not None and got.spilled and got.index == third   # second is 2.5 over the least loaded too


@given(KEYS, st.lists(st.tuples(st.floats(min_value=0, max_value=50), st.booleans()), min_size=1, max_size=8),
       st.floats(min_value=0, max_value=10))
def test_the_choice_always_has_room_and_respects_the_bound(key: str, states: list[tuple[float, bool]],
                                                           margin: float) -> None:
    cands = [Candidate(i, load, room) for i, (load, room) in enumerate(states)]
    got = choose(key, cands, margin)
    with_room = [c for c in cands if c.room]
    if not with_room:
        assert got is None
        return
    assert got is not None
    chosen = cands[got.index]
    assert chosen.room and chosen.load <= min(c.load for c in with_room) + margin
    # Nothing before it in the key's order qualified.
    for index in order(key, [c.index for c in cands]):
        if index == got.index:
            break
        c = cands[index]
        assert not c.room or c.load > min(x.load for x in with_room) + margin
    assert got.spilled == (got.index != order(key, [c.index for c in cands])[0])


def test_the_key_table_is_bounded_and_forgets_a_replicas_keys() -> None:
    table = KeyTable(limit=3)
    for i, key in enumerate("abcd"):
        table.note(key, i % 2)
    assert sum(table.counts().values()) == 3                  # "a" went first
    table.forget(1)
    assert table.counts() == Counter({0: 1})                 # "c" on 0; "b" was dropped, "d" forgotten


def runtime(n: int = 3, **options: object) -> ModelRuntime:
    config = replace(CONFIG, options={**CONFIG.options, **options})
    rt: ModelRuntime = ready_runtime(config, n)
    return rt


def test_pick_replica_sends_a_key_to_its_own_replica_every_time() -> None:
    rt = runtime()
    home = order("chat", [0, 1, 2])[0]
    assert {rt.pick_replica("chat").index for _ in range(5)} == {home}
    assert rt.replicas[home].affinity_picks == 5
    assert rt.describe()["replicas"][home]["affinity_keys"] == 1   # type: ignore[index]


def test_pick_replica_spills_a_full_home_and_counts_it_there() -> None:
    rt = runtime()
    home, second, _ = order("chat", [0, 1, 2])
    rt.replicas[home].inflight = 4                               # target_inflight: full
    rt.replicas[second].inflight = 1
    picked = rt.pick_replica("chat")
    assert picked is rt.replicas[second]
    assert rt.replicas[home].affinity_spills == 1 and rt.replicas[second].affinity_picks == 0


def test_a_key_that_spilled_has_the_replica_it_spilled_to_first_and_keeps_the_bound() -> None:
    home, second, third = order("chat", [0, 1, 2])
    cands = idle([0, 1, 2])
    assert choose("chat", cands, max_imbalance=1.0, moved=second) == \
        affinity.Choice(index=second, home=second, spilled=False, away=True)
    busy = [Candidate(i, 3.0 if i == second else 0.0, True) for i in (0, 1, 2)]
    # Too busy now: the next in the key's order is its rendezvous first, so it is not away any more.
    assert choose("chat", busy, max_imbalance=1.0, moved=second) == \
        affinity.Choice(index=home, home=second, spilled=True, away=False)
    # A replica it spilled to that is not READY any more is no preference.
    assert choose("chat", idle([home, third]), max_imbalance=1.0, moved=second) == \
        affinity.Choice(index=home, home=home, spilled=False)


def test_a_conversation_that_spilled_stays_where_its_cache_now_is() -> None:
    rt = runtime()
    home, second, _ = order("chat", [0, 1, 2])
    rt.replicas[home].inflight = 4                               # full: the conversation spills
    assert rt.pick_replica("chat") is rt.replicas[second]
    rt.replicas[home].inflight = 0                               # its first has room again
    assert rt.pick_replica("chat") is rt.replicas[second]        # but its last turn is cached here
    assert rt.replicas[second].affinity_picks == 1
    rt.set_replica_state(rt.replicas[second], ReplicaState.STARTING)   # that cache is gone
    assert rt.pick_replica("chat") is rt.replicas[home]
    rt.set_replica_state(rt.replicas[second], ReplicaState.READY)
    assert rt.pick_replica("chat") is rt.replicas[home]          # back on its rendezvous order


def test_the_default_bound_is_target_inflight() -> None:
    rt = runtime()
    assert rt.max_imbalance() == 4.0
    home = order("chat", [0, 1, 2])[0]
    rt.replicas[home].inflight = 3                               # 3 over idle replicas: still home
    assert rt.pick_replica("chat") is rt.replicas[home]
    wait = affinity.Wait()
    rt.replicas[home].inflight = 4                               # full, 4 over: worth waiting for
    assert rt.pick_replica("chat", wait) is None and wait.waiting
    assert runtime(affinity_max_imbalance=0).max_imbalance() == 0.0


def test_requests_waiting_for_a_replica_count_as_its_load() -> None:
    rt = runtime()
    home, second, _ = order("chat", [0, 1, 2])
    rt.replicas[home].inflight = 4
    first = affinity.Wait()
    assert rt.pick_replica("chat", first) is None                # 4 over idle ones: waits
    assert rt.pick_replica("chat", first) is None                # its own wait is not its load
    # One more for the same key: the replica has 4 running and 1 waiting, 5 over the idle ones.
    assert rt.pick_replica("chat", affinity.Wait()) is rt.replicas[second]
    assert rt.replicas[home].affinity_spills == 1
    rt.stop_waiting(first)                                       # the queue there is gone:
    key = next(k for k in (f"conv-{i}" for i in range(100)) if order(k, [0, 1, 2])[0] == home)
    assert rt.pick_replica(key, affinity.Wait()) is None         # another of its keys waits again


def test_a_replica_that_stops_loses_its_keys_and_only_they_move() -> None:
    rt = runtime()
    keys = [f"k{i}" for i in range(60)]
    before = {k: rt.pick_replica(k).index for k in keys}
    assert before == {k: order(k, [0, 1, 2])[0] for k in keys}
    rt.set_replica_state(rt.replicas[1], ReplicaState.STARTING)     # it crashed: supervisord restarts it
    assert rt.describe()["replicas"][1]["affinity_keys"] == 0        # type: ignore[index]
    after = {k: rt.pick_replica(k).index for k in keys}
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == 1}


def test_least_loaded_ignores_the_key() -> None:
    rt = runtime(routing="least_loaded")
    assert {rt.pick_replica("chat").index for _ in range(3)} == {0, 1, 2}     # idle replicas take turns
    assert all(r.affinity_picks == 0 for r in rt.replicas)


def test_a_patient_request_waits_for_its_full_home_while_it_is_within_the_bound() -> None:
    home, second, third = order("chat", [0, 1, 2])
    cands = [Candidate(home, 2.0, False), Candidate(second, 1.0, True), Candidate(third, 1.0, True)]
    assert choose("chat", cands, max_imbalance=1.0, patient=True) == \
        affinity.Choice(index=home, home=home, spilled=False, wait=True)
    # Impatient (affinity_max_wait_s spent, or 0): the next in the key's order, as before.
    assert choose("chat", cands, max_imbalance=1.0) == affinity.Choice(index=second, home=home, spilled=True, away=True)


def test_a_patient_request_spills_once_its_full_home_is_beyond_the_bound() -> None:
    home, second, third = order("chat", [0, 1, 2])
    cands = [Candidate(home, 2.0, False), Candidate(second, 2.0, False), Candidate(third, 0.0, True)]
    assert choose("chat", cands, max_imbalance=1.0, patient=True) == \
        affinity.Choice(index=third, home=home, spilled=True, away=True)


@given(KEYS, st.lists(st.tuples(st.floats(min_value=0, max_value=50), st.booleans()), min_size=1, max_size=8),
       st.floats(min_value=0, max_value=10))
def test_patience_only_turns_a_spill_from_a_full_home_within_the_bound_into_a_wait(
        key: str, states: list[tuple[float, bool]], margin: float) -> None:
    cands = [Candidate(i, load, room) for i, (load, room) in enumerate(states)]
    patient, impatient = choose(key, cands, margin, patient=True), choose(key, cands, margin)
    first = cands[order(key, [c.index for c in cands])[0]]
    with_room = [c for c in cands if c.room]
    if with_room and not first.room and first.load <= min(c.load for c in with_room) + margin:
        assert patient == affinity.Choice(index=first.index, home=first.index, spilled=False, wait=True)
    else:
        assert patient == impatient


def test_a_waiting_request_is_counted_once_lets_one_more_in_and_takes_its_home_when_a_place_frees() -> None:
    rt = runtime()
    home, second, third = order("chat", [0, 1, 2])
    rt.replicas[home].inflight, rt.replicas[second].inflight, rt.replicas[third].inflight = 4, 2, 2
    assert rt.admission.capacity == 12
    wait = affinity.Wait()
    assert rt.pick_replica("chat", wait) is None and rt.pick_replica("chat", wait) is None
    assert rt.replicas[home].affinity_waits == 1 and rt.replicas[home].affinity_spills == 0
    assert rt.admission.capacity == 13           # it waits at its replica: its ticket holds no place
    rt.release(rt.replicas[home])
    assert rt.pick_replica("chat", wait) is rt.replicas[home]
    assert rt.admission.capacity == 12 and rt.replicas[home].affinity_picks == 1


def test_a_request_no_longer_patient_spills_and_one_that_leaves_gives_back_its_extra_place() -> None:
    rt = runtime()
    home, second, third = order("chat", [0, 1, 2])
    rt.replicas[home].inflight, rt.replicas[second].inflight, rt.replicas[third].inflight = 4, 2, 2
    wait = affinity.Wait()
    assert rt.pick_replica("chat", wait) is None
    wait.patient = False                         # affinity_max_wait_s is over
    assert rt.pick_replica("chat", wait) is rt.replicas[second]
    assert rt.replicas[home].affinity_spills == 1 and rt.admission.capacity == 12
    # "chat" has its cache on `second` now; another conversation whose first is the full home:
    key = next(k for k in (f"conv-{i}" for i in range(100)) if order(k, [0, 1, 2])[0] == home)
    other = affinity.Wait()
    assert rt.pick_replica(key, other) is None and rt.admission.capacity == 13
    rt.stop_waiting(other)                       # the client left while it waited
    assert rt.admission.capacity == 12
    assert rt.pick_replica(key) is not None      # no Wait: never waits
    assert rt.replicas[home].affinity_waits == 2


def test_every_waiting_request_gives_its_place_to_the_queue_up_to_as_many_again() -> None:
    rt = runtime()
    home, second, third = order("chat", [0, 1, 2])
    rt.replicas[home].inflight, rt.replicas[second].inflight, rt.replicas[third].inflight = 4, 3, 3
    waits = [affinity.Wait() for _ in range(3)]
    assert all(rt.pick_replica("chat", w) is None for w in waits)
    # 10 running and 3 waiting of 15 admitted: the 2 admitted next have the 2 free places, whoever
    # they are for (it was 14: one place stayed idle while its own conversations queued behind).
    assert rt.admission.capacity == 12 + 3
    patient = runtime(affinity_max_imbalance=100)             # a bound that lets every request wait
    patient.replicas[home].inflight = 4
    more = [affinity.Wait() for _ in range(14)]
    assert all(patient.pick_replica("chat", w) is None for w in more)
    assert patient.admission.capacity == 12 + 12


def test_affinity_max_wait_s_null_waits_as_long_as_the_bound_holds() -> None:
    assert runtime(affinity_max_wait_s=1.0).max_wait_s() == 1.0
    assert runtime(affinity_max_wait_s=None).max_wait_s() == float("inf")
