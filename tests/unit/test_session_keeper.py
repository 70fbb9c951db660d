"""The session keeper's rules (serving/sessions/keeper.py's SessionShelf, the actor's logic without
Ray): the newest state wins, a checkpoint from a replica the session has left is refused, a claim
makes the claimant the owner (and the state, from then, a checkpoint), owners forget only their own,
states idle past their time to live go, the count and bytes kept are bounded, and a watched session is
found by its watch id too."""

from __future__ import annotations

import pytest

from vae_service.serving.sessions.keeper import CHECKPOINT, HANDOFF, SessionShelf


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def shelf():
    clock = Clock()
    shelf = SessionShelf(clock, max_kept=3, max_bytes=1000)
    shelf.clock_ = clock
    return shelf


def keep(shelf, sid="s", state="st", frames=4, kind=CHECKPOINT, owner="a", ttl_s=60.0, nbytes=100) -> bool:
    return shelf.keep(sid, state, frames, kind, owner, ttl_s, nbytes)


def test_the_newest_state_wins_and_an_older_one_is_dropped(shelf):
    assert keep(shelf, state="at4", frames=4)
    assert keep(shelf, state="at6", frames=6)
    assert not keep(shelf, state="at5", frames=5)  # a slow checkpoint arriving after a newer one
    assert shelf.claim("s", "b").state == "at6"


def test_a_claim_makes_the_claimant_the_owner_and_the_state_a_checkpoint(shelf):
    keep(shelf, kind=HANDOFF, owner=None)
    claimed = shelf.claim("s", "b")
    assert (claimed.kind, claimed.owner) == (HANDOFF, None)  # as it was handed over
    assert shelf.owner_of("s") == "b"
    assert shelf.claim("s", "c").kind == CHECKPOINT  # b lost before its first checkpoint: c resumes from it
    assert shelf.owner_of("s") == "c"


def test_a_checkpoint_from_a_replica_the_session_left_is_refused(shelf):
    keep(shelf, frames=4, owner="a")
    shelf.claim("s", "b")
    assert not keep(shelf, frames=8, owner="a")  # a's late checkpoint: the session lives on b now
    assert keep(shelf, frames=8, owner="b")
    assert shelf.claim("s", "c").latent_frames == 8


def test_a_released_claim_leaves_the_session_between_replicas(shelf):
    keep(shelf, kind=HANDOFF, owner=None)
    shelf.claim("s", "b")
    shelf.release("s", "c")  # not c's to release
    assert shelf.owner_of("s") == "b"
    shelf.release("s", "b")
    assert shelf.owner_of("s") is None


def test_an_owner_forgets_only_its_own(shelf):
    keep(shelf, owner="a")
    shelf.claim("s", "b")
    shelf.forget("s", "a")
    assert shelf.owner_of("s") == "b"
    shelf.forget("s", "b")
    assert shelf.claim("s", "c") is None


def test_states_idle_past_their_time_to_live_go_and_a_claim_refreshes_them(shelf):
    keep(shelf, sid="idle", ttl_s=10)
    keep(shelf, sid="used", ttl_s=10)
    shelf.clock_.t = 8
    shelf.claim("used", "b")
    shelf.clock_.t = 12
    assert shelf.claim("idle", "b") is None
    assert shelf.claim("used", "c") is not None


def test_the_count_and_the_bytes_kept_are_bounded(shelf):
    for i in range(3):
        assert keep(shelf, sid=f"s{i}", nbytes=300)
    assert not keep(shelf, sid="s3", nbytes=1)  # max_kept 3
    assert not keep(shelf, sid="s0", frames=5, nbytes=500)  # 300 + 300 + 500 over 1000 bytes
    assert keep(shelf, sid="s0", frames=5, nbytes=400)  # replacing its own 300: 1000 fits
    assert shelf.describe()["bytes"] == 1000 and shelf.describe()["sessions"] == 3


def test_a_watched_session_is_found_by_its_watch_id_while_it_is_kept(shelf):
    """Viewers' relays are routed by the watch id: the keeper answers for it as for the session's id."""
    assert shelf.keep("s", "st", 4, HANDOFF, None, 60.0, 100, alias="a.watch")
    assert shelf.owner_of("a.watch") is None  # between replicas
    shelf.claim("s", "b")
    assert shelf.owner_of("a.watch") == shelf.owner_of("s") == "b"
    shelf.forget("s", "b")
    assert shelf.owner_of("a.watch") is None and shelf.aliases == {}
    keep(shelf, sid="t")
    shelf.keep("u", "st", 4, CHECKPOINT, "c", 1.0, 100, alias="c.watch")
    shelf.clock_.t = 5.0  # u's time to live is over
    keep(shelf, sid="v")
    assert shelf.owner_of("c.watch") is None and "c.watch" not in shelf.aliases
