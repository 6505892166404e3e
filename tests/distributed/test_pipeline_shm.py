"""The same-host shared-memory transport of pipeline messages (megazero.pipeline.shm_link), with
real processes: messages of one tag are matched in order per direction, whatever order the
receives are waited in, through a ring smaller than the messages (so they travel in pieces and
queue); bf16, fp32 and int64 come out bit-equal; a dead or silent peer is an error naming both
ranks; no file is left behind. StageLinks picks it for CPU links on one host ("auto")."""

from __future__ import annotations

import datetime
import glob
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megazero.pipeline import StageLinks, p2p, shm_link

RING = 4096  # bytes per direction: every message below but the smallest needs several pieces


def _messages(src: int) -> list[tuple[int, torch.Tensor]]:
    """What rank `src` sends: (tag, tensor), 40 messages of varying shapes and dtypes, two tags."""
    generator = torch.Generator().manual_seed(src)
    messages = []
    for n in range(40):
        dtype = (torch.bfloat16, torch.float32, torch.int64)[n % 3]
        shape = (1 + n % 4, 7 + 13 * n)
        tensor = (torch.randn(shape, generator=generator) * 100).to(dtype)
        messages.append((n % 2, tensor))
    return messages


def _exchange_in_pieces() -> dict:
    """Both ranks send all their messages first (far more than the ring holds: most are queued),
    then post one receive per message and wait them last-posted first."""
    group = dist.new_group([0, 1])  # a channel of its own, with the small ring
    os.environ[shm_link.RING_BYTES_ENV] = str(RING)
    try:
        me = dist.get_rank()
        channel = shm_link.channel(group, 1 - me)
    finally:
        del os.environ[shm_link.RING_BYTES_ENV]
    for tag, tensor in _messages(me):
        channel.send(tensor, tag)
    queued = len(channel.queued)
    expected = _messages(1 - me)
    numbers = [(tag, channel.expect(tag)) for tag, _ in expected]
    got = {}
    for index in reversed(range(len(expected))):
        tag, number = numbers[index]
        shm_link.progress([channel], lambda t=tag, n=number: channel.has(t, n), "test receive from", 1 - me, 60)
        got[index] = channel.take(tag, number)
    shm_link.progress([channel], lambda: not channel.queued, "test flush to", 1 - me, 60)
    equal = [got[i].dtype == t.dtype and torch.equal(got[i], t) for i, (_, t) in enumerate(expected)]
    dist.barrier()
    dist.destroy_process_group(group)
    return {"queued": queued, "equal": equal, "ring": channel.out.size}


def test_messages_match_in_order_per_tag_through_a_ring_smaller_than_them(pools):
    for rank, result in enumerate(pools(2).run(_exchange_in_pieces)):
        assert result["ring"] == RING
        assert result["queued"] > 10, "the sends should have outgrown the ring"
        assert all(result["equal"]), f"rank {rank}: messages {[i for i, e in enumerate(result['equal']) if not e]}"


def _ping_pong() -> dict:
    """200 messages of 100 KB back and forth, each waited before the next is sent; then a new
    channel's setup after a destroyed group's."""
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    group = dist.new_group([0, 1])
    channel = shm_link.channel(group, peer)
    furthest = 0
    for n in range(200):
        if n % 2 == me:
            channel.send(torch.full((25600,), float(n)), 0)
            furthest = max(furthest, channel.written % channel.out.size or channel.out.size)
        else:
            number = channel.expect(0)
            shm_link.progress([channel], lambda k=number: channel.has(0, k), "test receive from", peer, 60)
            assert channel.take(0, number)[0].item() == n
    dist.barrier()
    dist.destroy_process_group(group)
    shm_link.channel(dist.group.WORLD, peer)
    return {"furthest": furthest, "closed": channel.closed}


def test_an_idle_ring_starts_again_at_its_head_and_a_destroyed_groups_channel_closes(pools):
    for result in pools(2).run(_ping_pong):
        assert result["furthest"] == 25600 * 4  # every message at the head: only its pages are touched
        assert result["closed"]


def _links_choice(setting: str | None, group=None) -> dict:
    links = StageLinks([0, 1], dist.get_rank(), group or dist.group.WORLD, torch.float32, torch.device("cpu"),
                       transport=setting)
    peer = 1 - dist.get_rank()
    links.send_forward(torch.full((3,), float(dist.get_rank()))) if peer == 1 else None
    received = links.recv_forward() if peer == 0 else None
    links.flush()
    return {"shm": sorted(links.shm), "pending": len(links.pending),
            "received": None if received is None else received.tolist()}


def test_stage_links_choose_shared_memory_on_one_host_for_cpu(pools):
    auto, backend = pools(2).run(_links_choice, None), pools(2).run(_links_choice, "backend")
    assert [r["shm"] for r in auto] == [[1], [0]]
    assert [r["shm"] for r in backend] == [[], []]
    assert auto[1]["received"] == backend[1]["received"] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"pipeline.p2p_transport: expected one of auto, backend, shm, got 'tcp'"):
        p2p.choose_transport("tcp", torch.device("cpu"), 0, 1)
    with pytest.raises(ValueError, match=r"'shm' needs CPU tensors; rank 0's link to rank 1 carries cuda"):
        p2p.choose_transport("shm", torch.device("cuda"), 0, 1)
    assert p2p.choose_transport("auto", torch.device("cuda"), 0, 1) == "backend"


def _rings_that_do_not_fit() -> dict:
    """Rings larger than /dev/shm's room (as in a default Docker container): auto goes through
    gloo with a warning, shm is an error naming both ranks; no directory is left behind."""
    stats = os.statvfs("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    before = set(glob.glob("/dev/shm/megazero-p2p-*"))
    os.environ[shm_link.RING_BYTES_ENV] = str(stats.f_bavail * stats.f_frsize // 2 + (1 << 20))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            auto = _links_choice(None, dist.new_group([0, 1]))
        try:
            _links_choice("shm", dist.new_group([0, 1]))
            required = "no error"
        except shm_link.ShmUnavailable as e:
            required = str(e)
    finally:
        del os.environ[shm_link.RING_BYTES_ENV]
    return {"auto": auto, "warnings": [str(w.message) for w in caught], "required": required,
            "left": sorted(set(glob.glob("/dev/shm/megazero-p2p-*")) - before)}


def test_rings_that_do_not_fit_in_dev_shm_fall_back_to_the_backend_or_are_an_error(pools):
    results = pools(2).run(_rings_that_do_not_fit)
    for rank, result in enumerate(results):
        assert result["auto"]["shm"] == [], result
        assert any("no shared-memory link between ranks 0 and 1" in w and "bytes free" in w
                   and f"rank {rank}'s link to rank {1 - rank} goes through the process group" in w
                   for w in result["warnings"]), result["warnings"]
        assert "no shared-memory link between ranks 0 and 1" in result["required"], result["required"]
        assert result["left"] == [], result["left"]
    assert results[1]["auto"]["received"] == [0.0, 0.0, 0.0]


# ---- a peer that dies or never sends: processes of their own (the pool's would be lost) --------
def _pair_worker(rank: int, port: int, behaviour: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    store = dist.distributed_c10d._get_default_store()
    name = dist.group.WORLD.group_name
    try:
        if behaviour == "no_setup" and rank == 1:  # never joins; reports the directory rank 0 made
            store.wait([f"megazero/p2p-shm/{name}/0-1/dir"])
            results.put((rank, store.get(f"megazero/p2p-shm/{name}/0-1/dir").decode().split("|")[0]))
            store.wait(["done"])
            return
        channel = shm_link.connect(store, name, rank, 1 - rank, timeout=2)
        path = store.get(f"megazero/p2p-shm/{name}/0-1/dir").decode().split("|")[0]
        if rank == 1:
            if behaviour == "dies":
                os._exit(3)  # no cleanup at all: the kernel closes its FIFO ends
            results.put((rank, path))
            store.wait(["done"])
            return
        channel.expect(0)
        try:
            shm_link.progress([channel], lambda: channel.has(0, 0), "receive of an activation from", 1, 3)
            results.put((rank, "received"))
        except RuntimeError as e:
            results.put((rank, f"{e} | left: {os.path.exists(path)}"))
    except RuntimeError as e:
        results.put((rank, str(e)))
    finally:
        store.set("done", "1")  # then a normal exit: atexit handlers (the files' removal) run


def _run_pair(behaviour: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_pair_worker, args=(r, port, behaviour, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=60) for _ in range(1 if behaviour == "dies" else 2))
    for p in procs:
        p.join(30)
    return got


def test_a_dead_peer_is_an_error_naming_both_ranks():
    error = _run_pair("dies")[0]
    assert ("shm p2p: rank 0's receive of an activation from rank 1 failed: rank 1 has closed its end of the "
            "link" in error), error
    assert error.endswith("left: False"), error  # the files went once both had opened them


def test_a_silent_peer_times_out_naming_both_ranks_and_no_files_remain():
    got = _run_pair("silent")
    assert "shm p2p: rank 0's receive of an activation from rank 1 timed out after 3s" in got[0], got[0]
    assert not os.path.exists(got[1])


def test_a_peer_that_never_joins_the_setup_is_named_and_the_files_go_at_exit():
    got = _run_pair("no_setup")
    assert "shm p2p: rank 0 waited 2s for rank 1 to open its ends of the link" in got[0], got[0]
    assert got[1].startswith(("/dev/shm/megazero-p2p-0-1-", "/tmp")) and not os.path.exists(got[1])
    assert not glob.glob(os.path.join(got[1], "*"))
