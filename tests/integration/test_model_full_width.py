"""A full-width Flux checkpoint (FLUX.1-dev's config: hidden 3072, 24 × 128 heads, the real block classes) sliced
to one block a stack: `cpdoctor model DIR --blocks 1 --ring 2 --dtype bf16` at 256×256 and 64 text tokens.

Only the shard holding what `--blocks 1` reads is written (random weights, ~1.1 GB in bf16); the index names
every tensor of the 19 + 38-block model, the rest in shards that are absent. The run is timed and its peak
resident memory (every process of the tree, summed, sampled from /proc) is held against the memory plan the
command printed. It needs ~10 GB and minutes of two cores, so it runs only with CPDOCTOR_FULL_WIDTH=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from hub_cache import FLUX_DEV

pytestmark = pytest.mark.skipif(os.environ.get("CPDOCTOR_FULL_WIDTH") != "1", reason="set CPDOCTOR_FULL_WIDTH=1 (≈10 GB, minutes)")


def write_sliced_checkpoint(path, blocks: int = 1) -> tuple[int, int]:
    """config.json, the index of the whole model, and the one shard with what `--blocks blocks` reads. Returns
    (tensors written, tensors the index names)."""
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from cpdoctor.model_zoo import slicing

    cls = FluxTransformer2DModel
    survey = slicing.survey(cls, FLUX_DEV)
    everything = slicing.selected_keys(cls, FLUX_DEV)
    torch.manual_seed(0)
    model = cls.from_config(slicing.sliced_config(FLUX_DEV, survey.stacks, blocks))
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    del model
    first = "diffusion_pytorch_model-00001-of-00003.safetensors"
    save_file(state, str(path / first), metadata={"format": "pt"})
    weight_map = {k: first if k in state else f"diffusion_pytorch_model-0000{2 + (hash(k) % 2)}-of-00003.safetensors" for k in everything}
    (path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.42.1", **FLUX_DEV}))
    return len(state), len(everything)


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            ppid, pages = int(fields[1]), int(fields[21])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
        rss[int(entry)] = pages * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def test_full_width_flux_one_block_a_stack(tmp_path, has_stale_kv_backward):
    written, named = write_sliced_checkpoint(tmp_path)
    out = tmp_path / "report.json"
    args = [
        sys.executable,
        "-m",
        "cpdoctor",
        "model",
        str(tmp_path),
        "--blocks",
        "1",
        "--ring",
        "2",
        "--dtype",
        "bf16",
        "--height",
        "256",
        "--width",
        "256",
        "--text-len",
        "64",
        "--timeout",
        "600",
        "--json",
        str(out),
    ]
    started = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.2)
    wall = time.perf_counter() - started
    stdout, stderr = proc.communicate()
    assert proc.returncode in (0, 1), stderr
    data = json.loads(out.read_text())
    finding = data["findings"][0]
    plan = finding["details"]["memory_plan"]
    read = finding["details"]["model"]["read"]
    print(
        f"\nwall {wall:.1f} s, peak RSS {peak / 2**30:.2f} GiB, plan {plan['device_peak'] / 2**30:.2f} GiB "
        f"(reference {plan['reference_dtype']}), read {read}, verdict {data['verdict']}, first bad {finding['details']['first_bad_block']}"
    )
    print(stderr)
    assert read["tensors_read"] == written < named == read["tensors_in_checkpoint"]
    # 0.39.0's stale-K/V ring backward: FAIL (the op-level cross-check at this layout catches what one bf16 step
    # of random weights hides at model level); 0.42.1 at ring 2: PASS. Wall time and peak memory against the plan
    # are printed above (figures for the README, not assertions: run with -s).
    assert data["verdict"] == ("FAIL" if has_stale_kv_backward else "PASS"), finding["diagnosis"]
