"""Checkpoint faults injected for real: a write that fails on one rank (RLIMIT_FSIZE: EFBIG), a full
tmpfs (ENOSPC), a SIGKILL between the two renames of a re-saved tag, corrupt files and a corrupt
`latest`, and retention. Each checks what survives: the previous checkpoint, `latest`, no temporary
directory left, and an error naming the file and the errno on every rank."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from megazero.checkpoint import CheckpointError, read_latest
from megazero.checkpoint.io import EXCHANGE_ENV, FAULT_ENV, remove_old_tags
from megazero.checkpoint.manifest import directory_problems
from tests.deepspeed_helpers import build_tiny, tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERIFY = os.path.join(REPO, "scripts", "verify_checkpoint.py")


def _step(engine, loader) -> None:
    batch = next(iter(loader))
    engine.backward(engine(batch))
    engine.step()


def _save_with_one_rank_limited(save_dir: str, stage: int) -> dict:
    """Save 'good'; then 'bad' with rank 1's files capped at 1 KiB (its RNG file is larger); then
    'after' with no cap, to show the process group is still in step."""
    engine, loader = build_tiny(tiny_config(stage))
    _step(engine, loader)
    engine.save_checkpoint(save_dir, "good", client_state={"step": 1})
    rank = torch.distributed.get_rank()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap then fails with EFBIG
    message, start = None, time.perf_counter()
    try:
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
        engine.save_checkpoint(save_dir, "bad", client_state={"step": 1})
    except CheckpointError as e:
        message = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    seconds = time.perf_counter() - start
    after_failure = {"latest": read_latest(save_dir), "entries": sorted(os.listdir(save_dir)),
                     "good": directory_problems(os.path.join(save_dir, "good"), checksums=True)}
    torch.distributed.barrier()
    engine.save_checkpoint(save_dir, "after", client_state={"step": 1})
    return {"message": message, "seconds": seconds, **after_failure, "latest_after": read_latest(save_dir)}


@pytest.mark.parametrize("stage,first_file", [(0, "rng_state_rank1.pt"),
                                              (2, "zero_pp_rank_1_mp_rank_00_optim_states.pt")])
def test_write_failing_on_one_rank_raises_on_every_rank(pools, tmp_path, stage, first_file):
    save_dir = str(tmp_path / "ckpt")
    results = pools(2).run(_save_with_one_rank_limited, save_dir, stage, timeout=120)
    for rank, result in enumerate(results):
        message = result["message"]
        assert message is not None, f"rank {rank} did not raise"
        assert f"rank 1: cannot write checkpoint file {save_dir}/.bad.tmp/{first_file}" in message, message
        assert "[Errno 27] EFBIG" in message, message
        assert result["latest"] == "good" and result["good"] == []
        assert result["entries"] == ["good", "latest"], "the temporary directory was left behind"
        assert result["latest_after"] == "after"
        print(f"fault EFBIG on rank 1 (ZeRO {stage}): rank {rank} raised {result['seconds']:.3f} s after the save "
              f"began")


def _save_until_full(mount: str) -> dict:
    engine, loader = build_tiny(tiny_config(0))
    _step(engine, loader)
    engine.save_checkpoint(mount, "good", client_state={"step": 1})
    fd = os.open(os.path.join(mount, "filler"), os.O_WRONLY | os.O_CREAT)
    try:  # take every free block
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    try:
        engine.save_checkpoint(mount, "bad", client_state={"step": 2})
        message = None
    except CheckpointError as e:
        message = str(e)
    os.remove(os.path.join(mount, "filler"))
    return {"message": message, "latest": read_latest(mount), "entries": sorted(os.listdir(mount)),
            "good": directory_problems(os.path.join(mount, "good"), checksums=True)}


def test_full_tmpfs_publishes_nothing(pools, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.decode().strip()}); the RLIMIT_FSIZE test covers "
                    f"failed writes")
    try:
        result = pools(1).run(_save_until_full, str(mount))[0]
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert result["message"] is not None and "[Errno 28] ENOSPC" in result["message"], result["message"]
    assert "cannot write checkpoint file" in result["message"] or "cannot create" in result["message"]
    assert result["latest"] == "good" and result["good"] == []
    assert result["entries"] == ["good", "latest"]


KILLED_BETWEEN_RENAMES = r"""
import os, megazero
from tests.deepspeed_helpers import build_tiny, tiny_config
megazero.init_distributed()
engine, loader = build_tiny(tiny_config(0))
for step in (1, 2):
    batch = next(iter(loader))
    engine.backward(engine(batch))
    engine.step()
    if step == 2:
        os.environ[{fault_env!r}] = "between_renames"
    engine.save_checkpoint({save_dir!r}, "same_tag", client_state={{"step": step}})
"""


def _load(load_dir: str, verify: bool = False, fallback: bool = False, tag=None) -> dict:
    engine, _ = build_tiny(tiny_config(0, checkpoint={"verify": verify}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            path, client = engine.load_checkpoint(load_dir, tag, fallback=fallback)
        except CheckpointError as e:
            return {"error": str(e)}
    return {"path": path, "client": client, "warnings": [str(w.message) for w in caught if "latest" in str(w.message)]}


@pytest.mark.parametrize("exchange", ["1", "0"], ids=["renameat2_exchange", "two_renames"])
def test_kill_between_renames_of_a_resaved_tag(pools, tmp_path, exchange):
    save_dir = str(tmp_path / "ckpt")
    env = {**os.environ, EXCHANGE_ENV: exchange, "OMP_NUM_THREADS": "1"}
    script = KILLED_BETWEEN_RENAMES.format(fault_env=FAULT_ENV, save_dir=save_dir)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    killed_at = time.time()
    assert read_latest(save_dir) == "same_tag"
    if exchange == "0":  # the kill left the tag's directory renamed away
        assert not os.path.isdir(os.path.join(save_dir, "same_tag"))
    result = pools(1).run(_load, save_dir, True)[0]
    assert "error" not in result, result
    # the exchange puts the complete new checkpoint in place in one step; two renames leave the
    # previous one under its replaced name, which loading puts back
    assert result["client"] == {"step": 2 if exchange == "1" else 1}
    assert directory_problems(os.path.join(save_dir, "same_tag"), checksums=True) == []
    print(f"fault SIGKILL between renames ({exchange=}): resumed {time.time() - killed_at:.2f} s after the kill, "
          f"steps lost {0 if exchange == '1' else 1}")
    assert subprocess.run([sys.executable, VERIFY, save_dir], capture_output=True).returncode == 0


def _save_tags(save_dir: str, tags: list[str], keep_last: int = 0) -> None:
    engine, loader = build_tiny(tiny_config(0, checkpoint={"keep_last": keep_last}))
    for step, tag in enumerate(tags, 1):
        _step(engine, loader)
        engine.save_checkpoint(save_dir, tag, client_state={"step": step})


def test_manifest_lists_every_file_and_layout(pools, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    pools(2).run(_save_tags, save_dir, ["a"])
    with open(os.path.join(save_dir, "a", "manifest.json")) as f:
        manifest = json.load(f)
    on_disk = sorted(set(os.listdir(os.path.join(save_dir, "a"))) - {"manifest.json"})
    assert sorted(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        assert entry["size"] == os.path.getsize(os.path.join(save_dir, "a", name))
    assert manifest["layout"] == {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 0, "world_size": 2, "format_version": 2}
    assert manifest["algorithm"] in ("crc32c", "crc32") and manifest["tag"] == "a"


def test_corrupt_and_truncated_files_are_named(pools, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    pools(1).run(_save_tags, save_dir, ["a"])
    ok = subprocess.run([sys.executable, VERIFY, save_dir], capture_output=True, text=True)
    assert ok.returncode == 0 and "whole" in ok.stdout, ok.stderr
    optim = os.path.join(save_dir, "a", "mp_rank_00_optim_states.pt")
    data = bytearray(open(optim, "rb").read())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size
    open(optim, "wb").write(bytes(data))
    bad = subprocess.run([sys.executable, VERIFY, save_dir, "--tag", "a"], capture_output=True, text=True)
    assert bad.returncode == 1 and optim in bad.stderr and "corrupt" in bad.stderr, bad.stderr
    verified = pools(1).run(_load, save_dir, True)[0]
    assert optim in verified["error"] and "corrupt" in verified["error"], verified
    open(optim, "wb").write(bytes(data[:100]))  # truncated: found without checksums too
    truncated = pools(1).run(_load, save_dir, False)[0]
    assert optim in truncated["error"] and "100 bytes, the manifest says" in truncated["error"], truncated
    sizes = subprocess.run([sys.executable, VERIFY, os.path.join(save_dir, "a"), "--sizes-only"],
                           capture_output=True, text=True)
    assert sizes.returncode == 1 and optim in sizes.stderr


@pytest.mark.parametrize("corruption", ["garbage", "missing_tag", "incomplete_tag"])
def test_corrupt_latest_names_the_previous_tag_and_fallback_loads_it(pools, tmp_path, corruption):
    save_dir = str(tmp_path / "ckpt")
    pools(1).run(_save_tags, save_dir, ["a", "b"])
    latest = os.path.join(save_dir, "latest")
    if corruption == "garbage":
        open(latest, "wb").write(b"\xff\xfe\x00 not a tag\n/..")
    elif corruption == "missing_tag":
        open(latest, "w").write("global_step999")
    else:
        model = os.path.join(save_dir, "b", "mp_rank_00_model_states.pt")
        open(model, "r+b").truncate(10)
    # the newest complete tag other than the one `latest` names
    tag, step = ("a", 1) if corruption == "incomplete_tag" else ("b", 2)
    refused = pools(1).run(_load, save_dir)[0]
    assert refused["error"].startswith(latest + " "), refused
    assert f"the previous complete tag is {tag!r}" in refused["error"], refused
    loaded = pools(1).run(_load, save_dir, False, True)[0]
    assert loaded["path"] == os.path.join(save_dir, tag) and loaded["client"] == {"step": step}, loaded
    assert any(f"loading the previous complete tag {tag!r}" in w for w in loaded["warnings"]), loaded
    bad = subprocess.run([sys.executable, VERIFY, save_dir], capture_output=True, text=True)
    assert bad.returncode == 1 and latest in bad.stderr


def test_keep_last_deletes_older_tags_only_after_a_newer_one_is_complete(pools, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    pools(2).run(_save_tags, save_dir, ["t1", "t2", "t3", "t4"], 2)
    assert sorted(os.listdir(save_dir)) == ["latest", "t3", "t4"] and read_latest(save_dir) == "t4"
    open(os.path.join(save_dir, "latest"), "w").write("t3")  # `latest` naming an older tag is never deleted
    assert remove_old_tags(save_dir, 1) == []
    shutil.copytree(os.path.join(save_dir, "t4"), os.path.join(save_dir, ".t5.tmp"))  # incomplete: not a tag
    assert remove_old_tags(save_dir, 1) == [] and os.path.isdir(os.path.join(save_dir, "t4"))
    pools(1).run(_save_tags, save_dir, ["t5"], 1)
    assert sorted(os.listdir(save_dir)) == ["latest", "t5"]


def test_a_corrupt_file_in_the_latest_tag_names_the_previous_tag_and_fallback_loads_it(pools, tmp_path):
    """A flipped byte keeps every size: only the checksums (checkpoint.verify) see it, and the way
    back is the same as for a corrupt `latest`."""
    save_dir = str(tmp_path / "ckpt")
    pools(1).run(_save_tags, save_dir, ["a", "b"])
    optim = os.path.join(save_dir, "b", "mp_rank_00_optim_states.pt")
    data = bytearray(open(optim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(optim, "wb").write(bytes(data))
    refused = pools(1).run(_load, save_dir, True)[0]
    assert optim in refused["error"] and "the previous complete tag is 'a'" in refused["error"], refused
    loaded = pools(1).run(_load, save_dir, True, True)[0]
    assert loaded["path"] == os.path.join(save_dir, "a") and loaded["client"] == {"step": 1}, loaded
    assert any("loading the previous complete tag 'a'" in w for w in loaded["warnings"]), loaded
    named = subprocess.run([sys.executable, VERIFY, save_dir], capture_output=True, text=True)
    assert named.returncode == 1 and optim in named.stderr and "previous complete tag is 'a'" in named.stderr
