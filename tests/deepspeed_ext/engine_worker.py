"""A rank of a multi-process MoC test: builds a tiny GPT-MoE DeepSpeed engine and acts.

Run as N processes by ``tests.launch.run_ranks`` with ``script=`` this file:

    engine_worker.py ACTION OUT_DIR [trainer flags...]

ACTION is ``describe`` (write this rank's fragment metadata), ``train-save`` (train
``--train-iters`` steps on synthetic tokens, saving every ``--save-interval`` with
MoC), ``load-train-save`` (load from ``--load``, then the same) or ``load-resave``
(load, then save at once under the tag ``resaved`` into ``--save``) or
``snapshot-identity`` (two-level snapshots after the optimizer's moments were replaced
by new tensors) or ``stages`` (a snapshot's copy and seal, the seal held at a gate) or
``reload-memory`` (two-level: train on past a snapshot, then load it
back in the same process) or ``early-save`` (a save while the optimizer has no moments,
as before the first fp16 step that does not overflow). Each rank writes
``OUT_DIR/rank<R>.json`` with what the test checks.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.training.arguments import (moc_config_from_args, padded_vocab_size,  # noqa: E402
                                         parse_args, validate_args)
from deepspeed_ext.engine.rng import set_seed  # noqa: E402
from deepspeed_ext.keeper.persist import HANG_PERSIST_ENV  # noqa: E402
from megatron.training.training import initialize_distributed, setup_model_and_optimizer  # noqa: E402

HUNG_KEEPER_STEP = None
"""MOC_FAULT_HANG_PERSIST_STEP as the keeper got it (see main)."""

BASE = ["--config", "configs/tiny.yaml", "--data-path", "unused", "--lr-warmup-iters", "0",
        "--hidden-dropout", "0",
        "--attention-dropout", "0"]


def _batch(args, step, micro):
    """Synthetic tokens that depend only on (global step, micro step, data-parallel rank)."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    tokens = torch.randint(0, 257, (args.micro_batch_size, args.seq_length + 1), generator=gen)
    pos = torch.arange(args.seq_length).expand(args.micro_batch_size, -1)
    return tokens[:, :-1], pos, tokens[:, 1:]


def _train(engine, args, start, stop, save_dir, states=None):
    losses = []
    for step in range(start, stop):
        for micro in range(args.gradient_accumulation_steps):
            tokens, pos, labels = _batch(args, step, micro)
            lm, aux, counts = engine(tokens, pos, labels)
            engine.backward(lm + args.moe_loss_coeff * aux)
            engine.step()
        counts = counts.clone()
        dist.all_reduce(counts)
        engine.moc.observe_tokens(counts.tolist())
        losses.append(lm.item())
        if save_dir and args.save_interval and (step + 1) % args.save_interval == 0:
            engine.save_checkpoint(save_dir, client_state={"step": step + 1})
            if states is not None:
                states[step + 1] = _state(engine)
            _kill_keeper_at(engine, step + 1)
            if str(step + 1) in os.environ.get("MOC_TEST_WAIT_AFTER_STEP", "").split(","):
                engine.moc.wait()  # that step is committed: the next snapshot persists
    return losses


def _state(engine):
    """Full fp32 master weights and moments, gathered from the fragments of every rank."""
    from deepspeed_ext.state import describe_local_state
    frags = describe_local_state(engine, engine.moc.naming)
    local = [(f.name, f.kind, f.offset, f.tensor.detach().cpu().tolist()) for f in frags]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    full = {}
    for rank_frags in gathered:
        for name, kind, offset, values in rank_frags:
            full.setdefault(f"{name}|{kind}", {})[offset] = values
    # Flatten each tensor's fragments in offset order (replicas give the same offset).
    return {key: [v for _, vals in sorted(parts.items()) for v in vals] for key, parts in full.items()}


def _kill_keeper_at(engine, step):
    """MOC_TEST_KILL_KEEPER_STEP: once that step's snapshot is copied (and its persist
    handed to the keeper), the first rank of each node SIGKILLs its node's keeper; with
    MOC_FAULT_HANG_PERSIST_STEP at that step, only once the keeper hangs in the middle
    of that step's persist (a rank's file written, its report not)."""
    two_level = engine.moc.two_level
    if os.environ.get("MOC_TEST_KILL_KEEPER_STEP") != str(step) or not two_level.first_of_node:
        return
    import time
    from deepspeed_ext.keeper import LOG_NAME, is_dead, request
    two_level.join_copy()
    if HUNG_KEEPER_STEP == str(step):
        log, deadline = os.path.join(two_level.node_dir, LOG_NAME), time.monotonic() + 60
        while f"'s file of global_step{step}" not in open(log).read():  # persist.py's line
            assert time.monotonic() < deadline, "the keeper never hung in the persist"
            time.sleep(0.01)
    os.kill(request(two_level.node_dir, {"op": "ping"})["pid"], 9)
    deadline = time.monotonic() + 30
    while not is_dead(two_level.node_dir):  # until the kernel has closed its socket
        assert time.monotonic() < deadline, "the killed keeper still accepts connections"
        time.sleep(0.01)


def _record_hashed_files():
    """The files this rank checksums (``storage.sha256_file``), in order."""
    from deepspeed_ext.format import storage
    real, hashed = storage.sha256_file, []

    def recording(path):
        hashed.append(os.path.relpath(path, os.path.dirname(os.path.dirname(path))))
        return real(path)
    storage.sha256_file = recording
    return hashed


def _record_manifest_reads():
    """The manifests this rank reads (``manifest.read_manifest``), in order: replaced in
    every module of the package that imported it by name (the store's modules do), not
    only in its own (which alone recorded nothing)."""
    import importlib
    import pkgutil
    import deepspeed_ext.store
    from deepspeed_ext.format import manifest
    for info in pkgutil.iter_modules(deepspeed_ext.store.__path__):
        importlib.import_module(f"deepspeed_ext.store.{info.name}")
    real, read = manifest.read_manifest, []

    def recording(ckpt_dir):
        read.append(os.path.basename(ckpt_dir))
        return real(ckpt_dir)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("deepspeed_ext") and \
                getattr(module, "read_manifest", None) is real:
            module.read_manifest = recording
    return read


def _inject_save_failure(engine):
    """MOC_TEST_FAIL_RANK/MOC_TEST_FAIL_STEP: that rank's file write raises at that step."""
    if os.environ.get("MOC_TEST_FAIL_RANK") != str(dist.get_rank()):
        return
    from deepspeed_ext.format import storage
    real = storage.write_image_file
    fail_tag = f"global_step{int(os.environ['MOC_TEST_FAIL_STEP'])}"

    def failing(path, image):
        if os.path.basename(os.path.dirname(path)) == fail_tag:
            raise OSError(28, "No space left on device (injected)")
        return real(path, image)
    storage.write_image_file = failing


def _failing_on_call(real, n, error):
    """``real``, except that its ``n``-th call raises ``error`` (a one-off fault)."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise error
        return real(*args, **kwargs)
    return wrapper


def _inject_restore_failure():
    """MOC_TEST_FAIL_RESTORE_RANK: that rank's first restore of the optimizer's scalars
    raises (later ones work), as a rank-local failure in the middle of a recovery."""
    if os.environ.get("MOC_TEST_FAIL_RESTORE_RANK") != str(dist.get_rank()):
        return
    from deepspeed_ext import session
    session.set_optimizer_scalars = _failing_on_call(
        session.set_optimizer_scalars, 1, ValueError("optimizer scalars do not fit (injected)"))


def _inject_describe_failure():
    """MOC_TEST_FAIL_MOMENTS_RANK: creating the optimizer's moments for a load raises
    MemoryError on that rank (one rank out of memory while the others load)."""
    if os.environ.get("MOC_TEST_FAIL_MOMENTS_RANK") != str(dist.get_rank()):
        return
    from deepspeed_ext import state

    def failing(engine):
        raise MemoryError("cannot allocate the Adam moments (injected)")
    state.ensure_optimizer_state = failing  # what every load's prepare_optimizer_state calls


def _inject_slot_failure(engine):
    """MOC_TEST_FAIL_SLOT_RANK: that rank's second snapshot cannot size its shared-memory
    slot (ENOSPC, as a full /dev/shm on one node)."""
    if (os.environ.get("MOC_TEST_FAIL_SLOT_RANK") != str(dist.get_rank())
            or engine.moc.two_level is None):
        return
    slots = engine.moc.two_level.slots
    slots.buffer = _failing_on_call(slots.buffer, 2,
                                    OSError(28, "No space left on device (injected)"))


def _inject_peer_store_failure(engine):
    """MOC_TEST_FAIL_PEER_STORE_RANK: that rank cannot make room for the second peer
    snapshot it is sent (ENOSPC, its node's memory full), in the middle of a protection."""
    if (os.environ.get("MOC_TEST_FAIL_PEER_STORE_RANK") != str(dist.get_rank())
            or engine.moc.two_level is None or engine.moc.two_level.redundancy is None):
        return
    store = engine.moc.two_level.redundancy.store
    store.allocate = _failing_on_call(store.allocate, 2,
                                      OSError(28, "No space left on device (injected)"))


def _inject_outcome_failure():
    """MOC_TEST_FAIL_OUTCOME_RANK: that rank's first look at a persist's outcome on
    storage raises (a transient storage error), just before a snapshot's exchange."""
    if os.environ.get("MOC_TEST_FAIL_OUTCOME_RANK") != str(dist.get_rank()):
        return
    from deepspeed_ext.store import commit
    commit.commit_outcome = _failing_on_call(
        commit.commit_outcome, 1, OSError(5, "Input/output error (injected)"))


def _snapshot_identity(engine, args):
    """Snapshots keep describing the live state when the optimizer's moments are replaced
    by new tensors between two of them (what a torch ``load_state_dict`` does)."""
    import copy
    from deepspeed_ext.snapshot import SlotImage
    from deepspeed_ext.state import base_optimizer, describe_local_state, state_identity
    two = engine.moc.two_level
    out = {}
    _train(engine, args, 0, 1, None)
    engine.save_checkpoint(args.save)  # describes (and caches) the fragments
    first = state_identity(engine)
    _train(engine, args, 1, 2, None)
    out["same_after_step"] = first.same(state_identity(engine))
    opt = base_optimizer(engine)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new moment tensors
    for state in opt.state.values():
        for kind in ("exp_avg", "exp_avg_sq"):
            if kind in state:
                state[kind].fill_(0.25 + dist.get_rank())
    out["changed_after_replace"] = not first.same(state_identity(engine))
    engine.save_checkpoint(args.save)
    two.join_copy()
    image = SlotImage(two.slots.image_path(two.last.slot))
    entries = {e["key"]: e for e in two.last.meta["entries"]}
    live = [f for f in describe_local_state(engine, engine.moc.naming) if f.key in entries]
    out["moments_in_snapshot"] = sum(f.kind in ("exp_avg", "exp_avg_sq") for f in live)
    out["snapshot_equals_live_state"] = all(
        torch.equal(image.read(entries[f.key]), f.tensor.detach().cpu().reshape(-1)) for f in live)
    image.close()
    return out


def _gated_checksum():
    """Hold every memory checksum until the returned event is set (the seal thread waits
    for it; the training thread must not)."""
    import threading
    from deepspeed_ext.format import memsum
    gate, real = threading.Event(), memsum.digest

    def gated(*a, **k):
        gate.wait()
        return real(*a, **k)
    memsum.digest = gated
    return gate


def _stages(engine, args):
    """The copy and seal stages (``deepspeed_ext.two_level.stages``), with the seal's
    checksum held at a gate: the optimizer step waits for the copy only; a slot is
    published only once sealed, with the right checksum; a save waits for a seal only
    when no slot is free, and that wait is its slot wait; slots are mapped once at
    start-up whatever the expert set; the per-snapshot metadata file is small."""
    import threading
    from deepspeed_ext.format import memsum
    from deepspeed_ext.snapshot import SlotImage
    two, out = engine.moc.two_level, {}
    out["maps_at_start"], out["slots"] = two.slots.maps_created, two.place.num_slots
    _train(engine, args, 0, 1, None)
    engine.save_checkpoint(args.save)  # step 1, sealed: the newest complete snapshot
    engine.moc.wait()  # and persisted (the first snapshot is due), so no slot is busy
    _train(engine, args, 1, 2, None)
    gate = _gated_checksum()
    engine.save_checkpoint(args.save)  # A (step 2): copied, its seal held at the gate
    slot_a, state_a = two.last.slot, _state(engine)
    _train(engine, args, 2, 3, None)   # the wrapped step must not wait for A's seal
    out["step_returned_with_gate_closed"] = not gate.is_set()
    out["unsealed_not_published"] = two.slots.meta(slot_a) is None
    engine.save_checkpoint(args.save)  # B (step 3): a slot is free, no wait for A's seal
    timing_b = two.timings[-1]
    out["b_slot_wait_s"], out["b_returned_with_gate_closed"] = timing_b.slot_wait_s, not gate.is_set()
    _train(engine, args, 3, 4, None)
    threading.Timer(0.5, gate.set).start()
    engine.save_checkpoint(args.save)  # C (step 4): step 1 newest complete, A and B
    # sealing: no free slot, so it waits for A's seal
    out["c_slot_wait_s"] = two.timings[-1].slot_wait_s
    two.join_copy()
    meta = two.slots.meta(slot_a)
    image = SlotImage(two.slots.image_path(slot_a))
    entries = {e["key"]: e for e in meta["entries"]}
    out["a_step"] = meta["step"]
    with open(two.slots.image_path(slot_a), "rb") as f:
        data = f.read(max(e["start"] + e["nbytes"] for e in entries.values()))
    out["a_checksum_matches"] = memsum.verify(data, meta["checksum"]) is None
    out["a_checksum_is_chunked"] = meta["checksum"].split(":")[0] == memsum.default_algorithm()
    from deepspeed_ext.state import describe_local_state
    frags = [f for f in describe_local_state(engine, engine.moc.naming) if f.key in entries]
    out["a_holds_step_2_state"] = all(
        image.read(entries[f.key]).tolist()
        == state_a[f"{f.name}|{f.kind}"][f.offset:f.offset + f.length] for f in frags)
    image.close()
    timings = two.timings
    out["sealed"] = all(t.sealed for t in timings)
    out["copies"] = [t.copies for t in timings]
    out["fragments"] = len(entries)
    out["maps_after"], out["grown"] = two.slots.maps_created, two.slots.grown
    out["experts"] = sorted({tuple(two.slots.meta(i)["experts"] or [])
                             for i, _ in two.slots.complete()})
    out["slot_json_bytes"] = max(os.path.getsize(os.path.join(two.slots.dir, f"slot{i}.json"))
                                 for i, _ in two.slots.complete())
    out.update(_whole_state_plan(engine))
    return out


def _whole_state_plan(engine):
    """The copy plan of this rank's whole ZeRO-2 state laid out in source order: how many
    runs each flat source (fp32 partition, exp_avg, exp_avg_sq per param group) takes."""
    from deepspeed_ext.format.copy_plan import plan_copies, run_copies, source_order
    from deepspeed_ext.format.image import layout_of
    from deepspeed_ext.state import describe_local_state
    tensors = {f.key: f.tensor for f in describe_local_state(engine, engine.moc.naming)}
    layout = layout_of({k: tensors[k] for k in source_order(tensors)}, keep_order=True)
    plan = plan_copies(layout, tensors)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    sources = [tensors[r.keys[0]].untyped_storage().data_ptr() for r in plan.runs]
    return {"param_groups": len(engine.optimizer.single_partition_of_fp32_groups),
            "whole_copies": run_copies(buffer, layout, plan, tensors),
            "runs_per_source": sorted(sources.count(p) for p in set(sources)),
            "key_order_runs": len(plan_copies(layout_of(tensors), tensors).runs),
            "whole_read_back": all(
                torch.equal(buffer[e.start:e.start + e.nbytes].view(tensors[e.key].dtype),
                            tensors[e.key].detach().reshape(-1)) for e in layout.entries)}


def _reload_memory(engine, args):
    """Snapshot every step for 3 steps, train 2 more without, then load in the same
    process (the moments exist: the load describes the state once): the state must be
    the step-3 snapshot's again, from memory."""
    from deepspeed_ext.two_level import recovery
    if os.environ.get("MOC_TEST_LOAD_EXCHANGE_BYTES"):  # force the exchanges' slow path
        recovery.LOAD_EXCHANGE_BYTES = int(os.environ["MOC_TEST_LOAD_EXCHANGE_BYTES"])
    states = {}
    _train(engine, args, 0, 3, args.save, states)
    engine.moc.two_level.join_copy()
    _train(engine, args, 3, 5, None)
    out = {"moved_on": _state(engine) != states[3]}
    path, client = engine.moc.load(args.save)
    out.update(loaded=path, client_state=client, load_source=engine.moc.last_load_source,
               restored=_state(engine) == states[3], global_steps=int(engine.global_steps),
               exchange_capacity=engine.moc.two_level.load_exchanger.capacity)
    return out


def _drop_moments(engine):
    """As after an fp16 first step whose gradients overflowed: DeepSpeed skipped the
    optimizer's step, so it holds no moments and has linked none."""
    from deepspeed_ext.state import base_optimizer
    base_optimizer(engine).state.clear()
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        engine.optimizer._hp_optimizer_states_linked = False


def _early_save(engine, args):
    """Train step 1, drop the moments (:func:`_drop_moments`) and save (a two-level
    snapshot, or a single-level checkpoint) at step 1 without them; then train on to
    ``--train-iters`` without saving: the uninterrupted run (its state after every step).
    MOC_TEST_RELOAD: then load step 1 back in this process (the moments exist now and
    must go), train the same steps again saving every step (snapshots with moments),
    and load the newest of those back."""
    out = {"states": {}, "losses": []}
    _train(engine, args, 0, 1, None)
    _drop_moments(engine)
    engine.save_checkpoint(args.save, client_state={"step": 1})
    engine.moc.wait()
    out["states"][1] = _state(engine)
    for step in range(1, args.train_iters):
        out["losses"] += _train(engine, args, step, step + 1, None)
        out["states"][step + 1] = _state(engine)
    if not os.environ.get("MOC_TEST_RELOAD"):
        return out
    path, client = engine.moc.load(args.save)
    out["reloaded"] = {"source": engine.moc.last_load_source, "client_state": client,
                       "state": _state(engine)}
    again = {}
    out["losses_again"] = _train(engine, args, 1, args.train_iters, args.save, again)
    out["states_again"] = again
    engine.moc.two_level.join_copy()
    path, client = engine.moc.load(args.save)
    out["reloaded_newest"] = {"source": engine.moc.last_load_source, "client_state": client,
                              "state": _state(engine)}
    return out


def main():
    action, out_dir, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    args = parse_args(BASE + argv)
    validate_args(args, int(os.environ["WORLD_SIZE"]))
    initialize_distributed(args)
    set_seed(args.seed)
    args.true_vocab_size = 257  # the trainer's byte-level tokenizer, as training.py sets it
    args.padded_vocab_size = padded_vocab_size(257, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)
    engine, _ = setup_model_and_optimizer(args)
    from deepspeed_ext import enable_moc_checkpointing
    enable_moc_checkpointing(engine, moc_config_from_args(args))
    # The keeper, started now, inherits the hang; this process, which persists in
    # process once its keeper is gone, does not (as the trainer arms its keeper's faults).
    global HUNG_KEEPER_STEP
    HUNG_KEEPER_STEP = os.environ.pop(HANG_PERSIST_ENV, None)
    _inject_save_failure(engine)
    _inject_restore_failure()
    _inject_describe_failure()
    _inject_slot_failure(engine)
    _inject_peer_store_failure(engine)
    _inject_outcome_failure()
    result = {"rank": dist.get_rank()}
    if action == "describe":
        from deepspeed_ext.state import describe_local_state
        _train(engine, args, 0, 1, None)
        frags = describe_local_state(engine, engine.moc.naming)
        result["fragments"] = [(f.name, f.kind, list(f.shape), f.offset, f.length, f.expert,
                                list(f.holders)) for f in frags]
    elif action == "snapshot-identity":
        result.update(_snapshot_identity(engine, args))
    elif action == "reload-memory":
        result.update(_reload_memory(engine, args))
    elif action == "stages":
        result.update(_stages(engine, args))
    elif action == "early-save":
        result.update(_early_save(engine, args))
    elif action == "save-reload-resave":
        # Save steps 1-4, load step 2 in this process, train and save 3-4 again.
        _train(engine, args, 0, 4, args.save)
        engine.moc.wait()
        result["reloaded"] = engine.moc.load(args.save, tag="global_step2")[1]
        _train(engine, args, 2, 4, args.save)
        engine.moc.wait()
    else:
        start = 0
        if action.startswith("load"):
            hashed, manifests = _record_hashed_files(), _record_manifest_reads()
            path, client = engine.load_checkpoint(args.load)
            result["hashed_by_load"] = list(hashed)
            result["manifests_read_by_load"] = list(manifests)
            result["loaded"] = path
            result["client_state"] = client
            start = client["step"] if "step" in client else client["iteration"]  # the trainer's
            result["state_after_load"] = _state(engine)  # a collective: every rank calls it
            recovery = engine.moc.last_recovery
            result["recovery"] = recovery.to_json() if recovery is not None else None
        states = {}
        if action == "load-resave":
            engine.save_checkpoint(args.save, tag="resaved", client_state=client)
            args.train_iters = start
        result["losses"] = _train(engine, args, start, args.train_iters, args.save, states)
        if os.environ.get("MOC_TEST_END_BY_SHUTDOWN"):
            engine.moc.shutdown()  # the trainer's end: shutdown waits for the persists itself
        elif os.environ.get("MOC_TEST_CRASH") != "1" or os.environ.get("MOC_TEST_PERSIST_FIRST"):
            engine.moc.wait()  # with a crash: every snapshot on storage, memory kept
        elif engine.moc.two_level is not None:
            # The crash comes once the last snapshot is complete (and protected): its copy
            # runs behind the save call, and on a loaded machine a crash could otherwise
            # land before it is published, making recovery find the step before.
            engine.moc.two_level.join_copy()
            if engine.moc.two_level.redundancy is not None:
                engine.moc.two_level.redundancy.wait_slots()
        result["final_state"] = _state(engine)
        result["saved_states"] = states if dist.get_rank() == 0 else None
    if engine.moc.two_level is not None:
        result["load_source"] = engine.moc.last_load_source
        result["stall_s"] = engine.moc.stall_s
        result["host_memory_bytes"] = engine.moc.host_memory_bytes()
    crash = os.environ.get("MOC_TEST_CRASH") == "1"
    if not crash:
        engine.moc.shutdown()
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    if crash:  # a software failure: the process dies, the keeper and its memory stay
        os.kill(os.getpid(), 9)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from megatron.training.exit import exit_without_teardown  # noqa: E402
    exit_without_teardown(0)  # a clean end is exit 0, never a teardown abort (-6)
