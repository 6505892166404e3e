"""Convert a GPT, BERT or Llama checkpoint to another tensor/pipeline-parallel layout (optimizer state included).

    python scripts/convert_checkpoint.py --load CKPT_DIR --save OUT_DIR \
        --target-tensor-parallel-size T --target-pipeline-parallel-size P [--tag TAG]

The source may have any layout (TP, PP, DP, ZeRO stage). The output holds T x P model and
optimizer files and loads with any data-parallel size and ZeRO stage. Where T pads the vocabulary
differently, padding rows are added (zeros) or dropped: they are not part of the model. An engine
can also load a checkpoint of another layout directly; converting first makes each rank read only
its own files.
"""

from __future__ import annotations

import argparse
import os

from megazero.checkpoint.convert import StageParameter, write_converted
from megazero.checkpoint.engine_state import resolve_tag
from megazero.checkpoint.io import CheckpointError
from megazero.checkpoint.universal import read_parameter_states
from megazero.meta_device import skeleton
from megazero.tensor_parallel.utils import partition_of
from models.common import ModelConfig
from models.parallelize import build_stage, config_class_for


def stage_parameters(config: ModelConfig, pp: int) -> list[list[StageParameter]]:
    """Each target stage's parameters, in module order, from the stage built on the meta device."""
    whole = config.whole()  # whole tensors with the target's vocabulary padding: the shards are cut afterwards
    stages = []
    for pp_rank in range(pp):
        with skeleton():
            model = build_stage(whole, pp_rank, pp)
        stages.append([StageParameter(model.global_parameter_name(name), *partition_of(p), rows=p.shape[0])
                       for name, p in model.named_parameters()])
    return stages


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (holding `latest` and tag directories)")
    parser.add_argument("--tag", default=None, help="default: the tag named by `latest`")
    parser.add_argument("--save", required=True, help="output checkpoint directory")
    parser.add_argument("--target-tensor-parallel-size", type=int, required=True)
    parser.add_argument("--target-pipeline-parallel-size", type=int, required=True)
    args = parser.parse_args(argv)
    tag = resolve_tag(args.load, args.tag)
    if tag is None:
        raise CheckpointError(f"{args.load}: no 'latest' file and no --tag")
    states = read_parameter_states(os.path.join(args.load, tag))
    saved_config = states.engine.get("model_config")
    if saved_config is None:
        raise CheckpointError(f"{args.load}/{tag}: no model_config in the checkpoint (saved by a model without "
                              f"a `config`); cannot place its layers on pipeline stages")
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    config = config_class_for(saved_config)(**{**saved_config, "tensor_model_parallel_size": tp,
                                               "sequence_parallel": saved_config.get("sequence_parallel", False)})
    out = write_converted(states, args.save, tag, stage_parameters(config, pp), tp, config.to_dict())
    print(f"wrote {out}: tensor parallel {tp} x pipeline parallel {pp}, {len(states.weights)} parameters")
    return out


if __name__ == "__main__":
    main()
