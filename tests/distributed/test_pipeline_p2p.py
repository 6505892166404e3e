"""The pipeline's point-to-point exchange never relies on a send completing before the peer has
posted its receive (which deadlocks on NCCL, where gloo's buffered sends hide it): strict mode,
in which a send waits for the peer's receive, refuses an exchange that does, and the 1F1B
schedule runs in it on 4 stages, with 1 to 8 micro-batches of varying shapes, giving the
gradients of the whole model (float64: equal to ~1e-12), through shared memory and through gloo.
The header, pending-send and timed-out-send tests are the backend's (transport="backend")."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from megazero.pipeline import StageLinks, one_f_one_b, p2p

STAGES = 4
WIDTH = 6


def _send_first_exchange(strict: bool) -> str:
    """Each of two ranks sends before posting its receive (what _exchange did before issue 15)."""
    peer = 1 - dist.get_rank()
    p2p.set_strict(strict)
    os.environ[p2p.STRICT_TIMEOUT_ENV] = "3"
    try:
        mine, theirs = torch.full((4,), float(dist.get_rank())), torch.empty(4)
        works = p2p.post([dist.P2POp(dist.isend, mine, peer)])
        works += p2p.post([dist.P2POp(dist.irecv, theirs, peer)])
        for work in works:
            work.wait()
        return f"received {theirs[0].item():g}"
    except RuntimeError as e:
        return str(e)
    finally:
        p2p.set_strict(None)
        del os.environ[p2p.STRICT_TIMEOUT_ENV]


def test_strict_mode_refuses_a_send_posted_before_the_peers_receive(pools):
    assert pools(2).run(_send_first_exchange, False) == ["received 1", "received 0"]  # gloo hides it
    for rank, message in enumerate(pools(2).run(_send_first_exchange, True)):
        assert f"strict p2p: rank {rank}'s message 0 to rank {1 - rank} waited 3s" in message
        assert "deadlocks on NCCL" in message
    assert pools(2).run(_send_first_exchange, False) == ["received 1", "received 0"]  # the link still works


def _layers() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(STAGES))


def _inputs(micro: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    # batch sizes differ between micro-batches: every message's shape travels in its header
    return [torch.randn(1 + m % 3, WIDTH, dtype=torch.float64, generator=generator) for m in range(micro)]


def _loss(layer: torch.nn.Linear, x: torch.Tensor, last: bool) -> torch.Tensor:
    y = torch.tanh(layer(x))
    return y.pow(2).sum() if last else y


def _pipeline_gradients(micro: int, strict: bool, transport: str) -> dict:
    """This stage's gradients through 1F1B, and the same layer's gradients in the whole model."""
    stage = dist.get_rank()
    layers, inputs = _layers(), _inputs(micro)
    for x in inputs:  # the reference: every micro-batch through the whole model, in order
        for i, layer in enumerate(layers):
            x = _loss(layer, x, i == STAGES - 1)
        x.backward()
    expected = [p.grad.clone() for p in layers[stage].parameters()]
    layers.zero_grad(set_to_none=True)
    links = StageLinks(list(range(STAGES)), stage, dist.group.WORLD, torch.float64, torch.device("cpu"),
                       transport=transport)

    def forward_step(m: int, received):
        return _loss(layers[stage], inputs[m] if received is None else received, stage == STAGES - 1)

    def backward_step(m: int, output, output_grad) -> None:
        torch.autograd.backward(output, output_grad)

    p2p.set_strict(strict)
    try:
        one_f_one_b(micro, stage, STAGES, links, forward_step, backward_step)
    finally:
        p2p.set_strict(None)
    got = [p.grad for p in layers[stage].parameters()]
    return {"max_error": max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, expected))}


TRANSPORTS = ["shm", "backend"]  # shared memory (auto's choice here) and gloo


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "default"])
@pytest.mark.parametrize("micro", [1, 2, 3, 5, 8])  # fewer micro-batches than stages, as many, more
def test_one_f_one_b_gives_the_whole_models_gradients(pools, micro, strict, transport):
    for stage, result in enumerate(pools(STAGES).run(_pipeline_gradients, micro, strict, transport)):
        assert result["max_error"] <= 1e-12, f"stage {stage}: relative gradient error {result['max_error']:.2e}"


CHUNKS = 2


class _CountingLinks(StageLinks):
    """StageLinks counting the shape headers it sends."""

    headers = 0

    def _header(self, tensor):
        _CountingLinks.headers += 1
        return super()._header(tensor)


def _interleaved_gradients(micro: int, strict: bool, runs: int = 1, transport: str | None = None) -> dict:
    """This stage's model chunks' gradients through the interleaved schedule (chunk c of stage s is
    layer c * STAGES + s), and the same layers' gradients in the whole model. runs > 1: the inputs
    all of one shape, the schedule run `runs` times with a shape cache (headers counted per run)."""
    from megazero.pipeline import interleaved_one_f_one_b

    stage, total = dist.get_rank(), STAGES * CHUNKS
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(total))
    inputs = _inputs(micro) if runs == 1 else [x[:1] for x in _inputs(micro)]
    for x in inputs:
        for i, layer in enumerate(layers):
            x = _loss(layer, x, i == total - 1)
        x.backward()
    mine = [layers[c * STAGES + stage] for c in range(CHUNKS)]
    expected = [runs * p.grad for layer in mine for p in layer.parameters()]
    layers.zero_grad(set_to_none=True)
    order, shapes, headers = [], {}, []

    def forward_step(chunk: int, m: int, received):
        last = chunk == CHUNKS - 1 and stage == STAGES - 1
        return _loss(mine[chunk], inputs[m] if received is None else received, last)

    def backward_step(chunk: int, m: int, output, output_grad) -> None:
        order.append((chunk, m))
        torch.autograd.backward(output, output_grad)

    p2p.set_strict(strict)
    try:
        for _ in range(runs):
            links = _CountingLinks(list(range(STAGES)), stage, dist.group.WORLD, torch.float64, torch.device("cpu"),
                                   ring=True, shapes=shapes, shape_key="one shape" if runs > 1 else None,
                                   transport=transport)
            _CountingLinks.headers = 0
            interleaved_one_f_one_b(micro, stage, STAGES, CHUNKS, links, forward_step, backward_step)
            headers.append(_CountingLinks.headers)
    finally:
        p2p.set_strict(None)
    got = [p.grad for layer in mine for p in layer.parameters()]
    return {"max_error": max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, expected)),
            "last_backward": order[-1], "backwards": len(order) // runs, "headers": headers}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "default"])
@pytest.mark.parametrize("micro", [4, 8, 12])  # all warm-up (m == p), and a steady state
def test_interleaved_schedule_gives_the_whole_models_gradients(pools, micro, strict, transport):
    for stage, result in enumerate(pools(STAGES).run(_interleaved_gradients, micro, strict, 1, transport)):
        assert result["max_error"] <= 1e-12, f"stage {stage}: relative gradient error {result['max_error']:.2e}"
        assert result["backwards"] == micro * CHUNKS and result["last_backward"] == (0, micro - 1)


def test_shape_cache_leaves_out_the_headers_it_has_seen(pools):
    """Strict mode, 3 runs of the schedule over one shape cache: the first sends each link's
    activation and gradient header once (not one per message), the later ones none (headers are
    the backend's: shared-memory messages carry their shapes in their descriptors)."""
    for stage, result in enumerate(pools(STAGES).run(_interleaved_gradients, 8, True, 3, "backend")):
        assert result["max_error"] <= 1e-12, f"stage {stage}: relative gradient error {result['max_error']:.2e}"
        # in the ring every rank sends activations to the next stage and gradients to the previous one
        assert result["headers"] == [2, 0, 0], result["headers"]


def test_interleaving_needs_a_multiple_of_the_stages():
    from megazero.pipeline.interleaved import check_interleaving

    with pytest.raises(ValueError, match=r"gradient_accumulation_steps = 6\) to be a multiple of the "
                                         r"pipeline-parallel size 4"):
        check_interleaving(6, STAGES, CHUNKS)
    check_interleaving(6, STAGES, 1)  # plain 1F1B takes any number


def _send_while_the_receiver_waits(delay: float) -> dict:
    """Rank 0 sends an activation (4 MB, beyond any buffering) that rank 1 posts its receive of
    only `delay` seconds later; rank 0 notes when its send returned and when its flush did."""
    rank = dist.get_rank()
    links = StageLinks([0, 1], rank, dist.group.WORLD, torch.float32, torch.device("cpu"), transport="backend")
    message = torch.arange(1 << 20, dtype=torch.float32)
    dist.barrier()
    if rank == 0:
        links.send_forward(message)
        sent, pending = time.time(), len(links.pending)
        links.flush()
        return {"sent": sent, "pending": pending, "flushed": time.time(), "left": len(links.pending)}
    time.sleep(delay)
    posted = time.time()
    received = links.recv_forward()
    return {"posted": posted, "equal": torch.equal(received, message), "leaf": received.requires_grad}


def test_a_send_returns_before_the_peer_posts_its_receive_and_the_flush_waits_for_it(pools):
    sender, receiver = pools(2).run(_send_while_the_receiver_waits, 0.5)
    assert receiver["equal"] and receiver["leaf"]
    assert sender["sent"] < receiver["posted"], "send_forward blocked until the peer posted its receive"
    assert sender["pending"] == 2 and sender["left"] == 0  # its shape header and the tensor
    # the send could not complete before the receive was posted: the flush is what waited for it
    assert sender["flushed"] >= receiver["posted"]


class _RecordingLinks(StageLinks):
    """StageLinks remembering every send's works it kept pending."""

    def _keep(self, works, tensor, what, peer):
        self.kept = getattr(self, "kept", []) + list(works)
        super()._keep(works, tensor, what, peer)


def _schedules_leave_nothing_pending() -> list[tuple[int, int, bool]]:
    """1F1B (5 micro-batches, training and forward only) and the interleaved schedule (8, both):
    after each, (sends kept, still pending, all of them complete)."""
    from megazero.pipeline import interleaved_one_f_one_b

    stage = dist.get_rank()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(STAGES * CHUNKS)]
    inputs = _inputs(8)
    results = []
    for chunks in (1, CHUNKS):
        for forward_only in (False, True):
            links = _RecordingLinks(list(range(STAGES)), stage, dist.group.WORLD, torch.float64, torch.device("cpu"),
                                    ring=chunks > 1, transport="backend")
            last_chunk = chunks - 1

            def forward_step(c: int, m: int, received, chunks=chunks, last_chunk=last_chunk):
                x = inputs[m] if received is None else received
                return _loss(layers[c * STAGES + stage], x, stage == STAGES - 1 and c == last_chunk)

            def backward_step(c: int, m: int, output, output_grad) -> None:
                torch.autograd.backward(output, output_grad)

            backward = None if forward_only else backward_step
            if chunks == 1:
                one_f_one_b(5, stage, STAGES, links, lambda m, x: forward_step(0, m, x),
                            backward and (lambda m, y, g: backward_step(0, m, y, g)), forward_only)
            else:
                interleaved_one_f_one_b(8, stage, STAGES, chunks, links, forward_step, backward, forward_only)
            kept = getattr(links, "kept", [])
            results.append((len(kept), len(links.pending), all(work.is_completed() for work in kept)))
    return results


def test_every_schedule_ends_with_all_its_sends_complete(pools):
    for stage, results in enumerate(pools(STAGES).run(_schedules_leave_nothing_pending)):
        for (kept, pending, complete), case in zip(results, ["1F1B", "1F1B forward only", "interleaved",
                                                             "interleaved forward only"]):
            # only the last stage of a forward-only 1F1B sends nothing
            assert kept > 0 or (case == "1F1B forward only" and stage == STAGES - 1), (stage, case)
            assert pending == 0 and complete, f"stage {stage}, {case}: {pending} sends left pending"


def _timed_out_send() -> str | None:
    """Rank 0 sends on a link of its own (a timed-out gloo send closes its group's connections)
    to rank 1, which never receives; rank 0's flush waits 0.3 s. Returns its error."""
    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    links = StageLinks([0, 1], rank, group, torch.float32, torch.device("cpu"), transport="backend")
    error = None
    if rank == 0:
        links.send_forward(torch.ones(1 << 16))
        try:
            links.flush(timeout=datetime.timedelta(seconds=0.3))
        except RuntimeError as e:
            error = f"{e} (pending {len(links.pending)})"
    dist.barrier()
    dist.destroy_process_group(group)
    return error


def test_a_timed_out_send_surfaces_at_the_flush(pools):
    error, _ = pools(2).run(_timed_out_send)
    assert error is not None, "the flush returned although rank 1 never received"
    assert "pipeline p2p: rank 0's send of a shape header to rank 1 failed" in error and "Timed out" in error, error
    assert error.endswith("(pending 2)"), error  # kept: gloo may still read the tensors
