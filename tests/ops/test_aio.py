"""The async I/O op and its pure-Python engine against plain file reads and writes: sizes on and
off the block size and the 4096 alignment, offsets, aligned and unaligned tensors (O_DIRECT body +
buffered tail, or all buffered), bytes outside a request kept, concurrent requests on several
files and on one file, the scheduling options, and failing reads and writes raising an OSError
that names the path and errno."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from megazero.ops import aio as aio_module
from megazero.ops.aio import ALIGNMENT, AsyncIO, aio_op, aligned_empty

BLOCK = 8192
SIZES = [1, 4095, 4096, BLOCK + 1, 3 * BLOCK, 3 * BLOCK + 4097]
OFFSETS = [0, 4096, 1000]


@pytest.fixture(scope="module", params=["op", "python"])
def engine(request) -> str:
    if request.param == "op":
        built_op()
    return request.param


def make(engine: str, **kwargs) -> AsyncIO:
    kwargs = {"block_size": BLOCK, "queue_depth": 4, "thread_count": 2, **kwargs}
    return AsyncIO(use_op=engine == "op", **kwargs)


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def buffer(n: int, aligned: bool) -> torch.Tensor:
    """n bytes whose address is 4096-aligned, or deliberately not (one byte past an aligned one)."""
    return aligned_empty(n, torch.uint8) if aligned else aligned_empty(n + 1, torch.uint8)[1:]


def direct_io_allowed(directory) -> bool:
    try:
        os.close(os.open(os.path.join(directory, "probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False


def test_round_trips_equal_plain_file_io(engine, tmp_path):
    io = make(engine)
    direct = engine == "op" and direct_io_allowed(tmp_path)
    path = tmp_path / "f.bin"
    for nbytes in SIZES:
        for offset in OFFSETS:
            for aligned in (True, False):
                seed = nbytes * 7 + offset + aligned
                around = random_bytes(offset + nbytes + 100, seed).numpy().tobytes()
                path.write_bytes(around)
                data = buffer(nbytes, aligned)
                data.copy_(random_bytes(nbytes, seed + 1))
                io.write(data, path, offset)
                on_disk = path.read_bytes()
                case = f"{nbytes} bytes at offset {offset}, aligned={aligned}"
                assert on_disk[offset:offset + nbytes] == data.numpy().tobytes(), case
                assert on_disk[:offset] == around[:offset], case  # bytes outside the request are kept
                assert on_disk[offset + nbytes:] == around[offset + nbytes:], case
                if engine == "op" and nbytes >= ALIGNMENT:
                    body_direct = direct and aligned and offset % ALIGNMENT == 0
                    assert io.backend == ("cpp (O_DIRECT)" if body_direct else "cpp (buffered)"), case
                back = buffer(nbytes, not aligned)
                io.read(back, path, offset)
                assert torch.equal(back, data), case
    wide = torch.randn(3 * BLOCK + 5, dtype=torch.bfloat16)  # another dtype, through the same bytes
    io.write(wide, path, 4096)
    back = torch.empty_like(wide)
    io.read(back, path, 4096)
    assert torch.equal(back.view(torch.int16), wide.view(torch.int16))
    assert path.read_bytes()[4096:4096 + wide.nbytes] == wide.view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("options", [{}, {"single_submit": True}, {"overlap_events": False, "queue_depth": 1}])
def test_concurrent_requests_on_several_files(engine, tmp_path, options):
    io = make(engine, **options)
    sizes = [5 * BLOCK + 123, 4 * BLOCK, 7, 2 * BLOCK + 4096]
    expected = [random_bytes(n, n) for n in sizes]
    for i, n in enumerate(sizes):
        data = aligned_empty(n, torch.uint8)
        data.copy_(expected[i])
        io.submit_write(data, tmp_path / f"f{i}.bin")  # the test keeps no reference: AsyncIO must
    # two requests on one file at once, the second past the first's end (a swap file's layout)
    io.submit_write(expected[0].clone(), tmp_path / "shared.bin", 0)
    io.submit_write(expected[1].clone(), tmp_path / "shared.bin", 8 * BLOCK)
    io.wait()
    for i, want in enumerate(expected):
        assert (tmp_path / f"f{i}.bin").read_bytes() == want.numpy().tobytes()
    shared = (tmp_path / "shared.bin").read_bytes()
    assert shared[:sizes[0]] == expected[0].numpy().tobytes()
    assert shared[8 * BLOCK:] == expected[1].numpy().tobytes()
    backs = [aligned_empty(n, torch.uint8) for n in sizes]
    requests = [io.submit_read(b, tmp_path / f"f{i}.bin") for i, b in enumerate(backs)]
    for request in reversed(requests):
        io.wait(request)
    for back, want in zip(backs, expected):
        assert torch.equal(back, want)


def assert_oserror(info, code: int, path) -> None:
    assert info.value.errno == code, info.value
    assert info.value.filename == str(path)
    assert str(path) in str(info.value) and f"Errno {code}" in str(info.value) and os.strerror(code) in str(info.value)


def test_failing_io_raises_oserror_naming_path_and_errno(engine, tmp_path):
    io = make(engine)
    data = aligned_empty(3 * BLOCK, torch.uint8)
    data.copy_(random_bytes(data.numel(), 1))
    missing = tmp_path / "no-such-dir" / "f.bin"
    with pytest.raises(OSError) as info:
        io.write(data, missing)
    assert_oserror(info, errno.ENOENT, missing)
    if os.path.exists("/dev/full"):  # the open succeeds, the write itself fails
        with pytest.raises(OSError) as info:
            io.write(data, "/dev/full")
        assert_oserror(info, errno.ENOSPC, "/dev/full")
        assert "pwrite" in str(info.value)
    short = tmp_path / "short.bin"
    short.write_bytes(b"x" * 100)
    with pytest.raises(OSError) as info:
        io.read(data, short)
    assert_oserror(info, errno.ENODATA, short)
    if os.geteuid() != 0:  # root writes into a read-only directory regardless
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
        with pytest.raises(OSError) as info:
            io.write(data, locked / "f.bin")
        assert_oserror(info, errno.EACCES, locked / "f.bin")
    # wait() for all: the good requests complete, the failing one raises, none stays outstanding
    good = tmp_path / "good.bin"
    io.submit_write(data, good)
    io.submit_write(data, missing)
    io.submit_write(data, good, 3 * BLOCK)
    with pytest.raises(OSError) as info:
        io.wait()
    assert_oserror(info, errno.ENOENT, missing)
    assert good.read_bytes() == data.numpy().tobytes() * 2
    with pytest.raises(ValueError, match="not outstanding"):
        io.wait(12345)
    io.read(data, good)  # the handle still works


def test_tensor_and_argument_checks():
    io = AsyncIO(use_op=False)
    assert io.backend == "python"
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        io.submit_write(torch.zeros(4, 4).t(), "/tmp/x")
    with pytest.raises(TypeError, match="torch.Tensor"):
        io.submit_write(b"bytes", "/tmp/x")
    with pytest.raises(ValueError, match="offset"):
        io.submit_read(torch.zeros(4), "/tmp/x", -1)
    with pytest.raises(ValueError, match="block_size"):
        AsyncIO(block_size=0)
    for shape, dtype, alignment in (((3, 5), torch.float32, 4096), (7, torch.bfloat16, 512), ((0,), torch.int64, 4096)):
        t = aligned_empty(shape, dtype, alignment)
        assert t.data_ptr() % alignment == 0 and t.is_contiguous() and t.dtype == dtype
        assert t.shape == torch.Size([shape] if isinstance(shape, int) else shape)


def built_op():
    if aio_op() is None:
        pytest.fail("the aio op did not build (see the warning); it must build on this machine")


def test_report_names_the_aio_engine(capsys):
    from megazero.ops.__main__ import print_report

    built_op()
    print_report()
    out = capsys.readouterr().out
    assert "\naio " in out
    assert "aio engine: cpp op" in out
    assert aio_module.active_backend().startswith("cpp op")


def test_benchmark_smoke(tmp_path):
    """benchmarks/bench_aio.py at a tiny size: every row runs, reads back what it wrote, and lands
    in the JSON."""
    from benchmarks import bench_aio

    built_op()
    report = bench_aio.main(["--dir", str(tmp_path / "bench"), "--size-mb", "8", "--trials", "1",
                             "--out", str(tmp_path / "aio.json")])
    rows = report["results"]
    assert {"aio op, 1 MiB x qd 8, 1 thread", "aio python fallback, 4 threads", "torch.save / torch.load"} <= set(rows)
    assert all(r["write_GBps"] > 0 and r["read_GBps"] > 0 for r in rows.values())
    assert rows["aio python fallback, 4 threads"]["backend"] == "python"
    assert (tmp_path / "aio.json").exists() and not os.listdir(tmp_path / "bench")


def test_request_after_another_waits_for_it_and_is_cancelled_if_it_fails(engine, tmp_path):
    """A read submitted `after` a write of the same bytes reads what the write put; after a failing
    write it is not run (ECANCELED, its tensor untouched). busy_seconds counts the time in flight."""
    io = make(engine, queue_depth=2, thread_count=2)
    data, back = random_bytes(3 * BLOCK + 5, 7), torch.zeros(3 * BLOCK + 5, dtype=torch.uint8)
    path = tmp_path / "f.bin"
    write = io.submit_write(data, path)
    io.submit_read(back, path, after=write)
    io.wait()
    assert torch.equal(back, data)
    busy = io.busy_seconds()
    assert 0 < busy["read"] <= busy["any"] and 0 < busy["write"] <= busy["any"]
    back.zero_()
    write = io.submit_write(data, tmp_path / "missing" / "f.bin")
    read = io.submit_read(back, path, after=write)
    with pytest.raises(OSError) as failed:
        io.wait(write)
    assert failed.value.errno == errno.ENOENT
    with pytest.raises(OSError, match="not run") as cancelled:
        io.wait(read)
    assert cancelled.value.errno == errno.ECANCELED and cancelled.value.filename == str(path)
    assert not back.any()
    with pytest.raises(ValueError, match="not outstanding"):
        io.submit_read(back, path, after=read)


def test_concurrent_writes_into_one_file_never_cut_each_other_off(engine, tmp_path):
    """Pieces of one file written at once, each the file's new end when submitted (highest offset
    first): small unaligned pieces (buffered) extend the file from the workers while aligned ones
    (direct) grow it first at submit. Growing by fstat + ftruncate cut off a buffered piece that
    landed in between (a short read of it later: seen in the offloaded gradients' swap file); every
    piece must read back as written."""
    aio = make(engine, block_size=1 << 20, queue_depth=8)
    for trial in range(30):
        path = tmp_path / f"pieces{trial}.swp"
        pieces, offset = [], ALIGNMENT
        for i in range(64):
            size = 512 if i % 2 else 64 * 1024  # buffered whole / direct whole
            pieces.append((offset, random_bytes(size, 100 * trial + i)))
            offset += -(-size // ALIGNMENT) * ALIGNMENT
        in_flight = []  # the buffers, alive until written
        for at, data in reversed(pieces):
            in_flight.append(buffer(data.numel(), aligned=True))
            in_flight[-1].copy_(data)
            aio.submit_write(in_flight[-1], path, at)
        aio.wait()
        for at, data in pieces:
            back = buffer(data.numel(), aligned=True)
            aio.wait(aio.submit_read(back, path, at))
            assert torch.equal(back, data), f"the piece at {at} of {path} did not read back as written"
