"""One rank of the 2-process gloo test in test_gpt_dataset.py (not a test module).

usage: dist_worker.py RANK WORLD PORT PREFIX CACHE_DIR OUT_JSON
"""

import datetime
import json
import os
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from megatron.data import build_tokenizer, build_train_valid_test_datasets  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402


def make_args(data_path, cache):
    return types.SimpleNamespace(
        data_path=data_path, split="80,15,5", seq_length=16, seed=7, micro_batch_size=2,
        global_batch_size=4, train_iters=6, eval_interval=3, eval_iters=1,
        data_cache_path=cache,
    )


def samples(dataset, n=6):
    return [dataset[i]["tokens"].tolist() for i in range(n)]


def main():
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    prefix, cache, out = sys.argv[4], sys.argv[5], sys.argv[6]
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    tok = build_tokenizer("ByteLevelTokenizer")
    result = {}

    train, valid, test = build_train_valid_test_datasets(make_args([prefix], cache), tok)
    result["single"] = {"lens": [len(train), len(valid), len(test)], "train": samples(train)}

    blend = ["0.25", prefix, "0.75", prefix]
    train, valid, test = build_train_valid_test_datasets(make_args(blend, cache), tok)
    result["blend"] = {"lens": [len(train), len(valid), len(test)], "train": samples(train)}

    errors = []
    for data_path in ([prefix + "_missing"], [prefix + "_missing" if rank == 1 else prefix]):
        try:
            build_train_valid_test_datasets(make_args(data_path, cache), tok)
            errors.append(None)
        except ConfigError as err:
            errors.append(str(err))
    result["errors"] = errors

    # the ranks are still in step after the failures
    train, _, _ = build_train_valid_test_datasets(make_args([prefix], cache), tok)
    result["after"] = samples(train, 2)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    from megatron.training.exit import exit_without_teardown  # noqa: E402
    exit_without_teardown(0)  # a clean end is exit 0, never a teardown abort (-6)
