"""Before training, every rank: this rank's home in shared memory, the memory budget
check, and the node's keeper (:mod:`deepspeed_ext.two_level`)."""

import hashlib
import logging
import os
import traceback
from typing import Dict, List, Optional

import torch.distributed as dist

import deepspeed_ext.keeper as keeper
from deepspeed_ext.format import fs
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import rank_zero_lines
from deepspeed_ext.runtime.outcomes import MoCCheckpointError, all_outcomes, raise_if_failed
from deepspeed_ext.snapshot import SnapshotSlots
from deepspeed_ext.two_level.records import RankPlace

logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


def default_shm_dir(save_dir: str) -> str:
    """A shared-memory directory that is the same for every restart of one job (keyed by
    the absolute checkpoint directory, or its URL) and different for other jobs."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    digest = hashlib.sha256(fs.identity(save_dir).encode()).hexdigest()[:12]
    return os.path.join(root, f"moc-{os.getuid()}-{digest}")


def bytes_held(directory: str) -> int:
    """Bytes the files under ``directory`` occupy (a previous attempt's slot images this
    rank will reuse: already taken from the free space)."""
    total = 0
    for dirpath, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def short_nodes(gathered: List) -> List[str]:
    """Every rank, from the gathered ``(problem, needed, held, free, node, root)``: the
    nodes whose shared-memory filesystem cannot hold all their ranks' slots. The ranks
    of a node share it: checking each rank's need alone passed 8 ranks of 10 GiB on 30
    GiB free, and the copies then died of SIGBUS in the middle of a snapshot."""
    nodes: Dict[int, List] = {}
    for _, needed, held, free, node, root in gathered:
        entry = nodes.setdefault(node, [0, free, root, 0])
        entry[0] += max(0, needed - held)
        entry[3] += 1
    return [f"node {node}: {root} has {free / 2**30:.3f} GiB free, its {ranks} rank(s)' "
            f"snapshot slots need {want / 2**30:.3f} GiB more (point --moc-shm-dir at a "
            f"larger shared-memory filesystem, or enlarge it)"
            for node, (want, free, root, ranks) in sorted(nodes.items())
            if free is not None and want > free]


def check_memory_budget(place: RankPlace, frags) -> None:
    """Every rank, before training: make this rank's home in shared memory (private
    directories bound to this job, the snapshot slots; :func:`make_home`), then refuse a
    failure there, or a budget (or a shared-memory filesystem) too small for the slots,
    on every rank (one ``all_gather_object``), naming the flag or size to fix. Sets
    ``place.slots`` and ``place.budget_bytes``.

    Args:
        place: this rank's place (its ``copier`` and ``run_id`` set).
        frags: this rank's fragments (fp32 master weights; moments are as large).
    """
    home_problem = make_home(place)
    cfg, spec = place.cfg, place.spec
    # fp32 master weights plus Adam's two moments, for every slot.
    image = 3 * sum(f.length * 4 for f in frags)
    needed = place.num_slots * image
    if spec.enabled:  # what this rank holds for its peers
        from deepspeed_ext.peers import KEEP
        from deepspeed_ext.policy.redundancy import extra_bytes
        needed += extra_bytes(spec, image, KEEP)
    problem = None
    budget = cfg.host_memory_gb * 2**30
    if budget and needed > budget:
        problem = (f"rank {place.rank}: its {place.num_slots} snapshot slots need "
                   f"{needed / 2**30:.3f} GiB of host memory"
                   + (f" (with what it holds for its peers: --moc-redundancy "
                      f"{spec.describe()})" if spec.enabled else "")
                   + ", --moc-host-memory-gb allows "
                   f"{cfg.host_memory_gb:g}")
    root = os.path.dirname(os.path.abspath(cfg.shm_dir)) or "/"
    free = None
    if os.path.isdir(root):
        stat = os.statvfs(root)
        free = stat.f_bavail * stat.f_frsize
    gathered: List = [None] * place.world
    held = bytes_held(os.path.join(place.node_dir, f"rank{place.rank:05d}"))  # SnapshotSlots.dir
    dist.all_gather_object(gathered, (problem or home_problem, needed, held, free,
                                      place.node, root), group=metadata_group())
    problems = [p for p, *_ in gathered if p] + short_nodes(gathered)
    if problems:
        raise MoCCheckpointError("; ".join(problems))
    place.budget_bytes = needed
    _log(f"two-level checkpointing: up to {max(g[1] for g in gathered) / 2**20:.1f} MiB of "
         f"snapshot memory per rank ({place.num_slots} slots"
         + (f" and the peers' redundancy, {spec.describe()}" if spec.enabled else "")
         + f") under {cfg.shm_dir}")


def make_home(place: RankPlace) -> Optional[str]:
    """This rank, before the start-up exchange: make its node's directory private and
    bind it to this job's run id, and open its slots (``place.slots``); returns what
    went wrong (None: nothing), for every rank to raise. Starts no keeper: a job refused
    here leaves no process behind."""
    from deepspeed_ext.job_identity import ForeignJobError
    from deepspeed_ext.private_dir import UnsafeDirectoryError
    try:
        keeper.claim_node_dir(place.node_dir, place.run_id)
        place.slots = SnapshotSlots(place.node_dir, place.rank, slots=place.num_slots,
                                    on_map=place.copier.register,
                                    on_unmap=place.copier.unregister, run_id=place.run_id)
    except (UnsafeDirectoryError, ForeignJobError, keeper.KeeperError, OSError) as e:
        place.slots = None
        return f"rank {place.rank}: {e}"
    return None


def start_keeper(place: RankPlace) -> None:
    """Every rank, after the start-up checks: attach to (or start) the node's keeper;
    a keeper that does not answer on one node is raised on every rank (one
    collective), not left to that node's ranks while the others train on."""
    ok, error = True, None
    try:
        keeper.ensure_keeper(place.node_dir, place.cfg.keeper_idle_timeout_s,
                             run_id=place.run_id, save_dir=place.cfg.save_dir or None)
    except Exception as e:
        traceback.print_exc()
        ok, error = False, f"{type(e).__name__}: {e}"
    raise_if_failed(all_outcomes(ok, error), f"MoC keeper of {place.node_dir}")


HEADER_BYTES_PER_TENSOR = 512
"""Room in a slot for one tensor's record in the image's safetensors header (a record
is its key, dtype, shape and offsets: under 200 bytes for our keys)."""
SLOT_SLACK_BYTES = 1 << 20
"""Room in a slot for the objects' tensors besides every rank's RNG state."""


def slot_bytes(fragments, rng_bytes: int, world: int) -> int:
    """The size every slot is prepared at: the image of a full snapshot (every fragment:
    a partial-expert snapshot is smaller and fits too; Adam's two moments counted even
    before the optimizer made them), its header, and the objects' tensors of a snapshot
    due for storage (every rank's RNG state), with slack.

    Args:
        fragments: this rank's fragments (:func:`deepspeed_ext.state.describe_local_state`).
        rng_bytes: bytes of this rank's RNG state's tensors.
        world: ranks in the job.
    """
    from deepspeed_ext.state import FP32
    described = sum(f.tensor.numel() * f.tensor.element_size() for f in fragments)
    masters = [f for f in fragments if f.kind == FP32]
    state = max(described, 3 * sum(f.tensor.numel() * f.tensor.element_size() for f in masters))
    header = HEADER_BYTES_PER_TENSOR * (3 * len(masters) + len(fragments) + 4 * world + 64)
    return state + header + world * rng_bytes + SLOT_SLACK_BYTES


def prepare_slots(place: RankPlace, fragments) -> float:
    """Every rank, at start-up, before training: make every slot of this rank ready at
    the size of a full snapshot (allocated, mapped, on CUDA page-locked), so that no
    snapshot maps, grows or registers memory inside training (0.6 s per GB of
    ``cudaHostRegister`` inside the timed iterations, before). A failure (shared memory
    full) is raised on every rank (one collective). Returns this rank's seconds.
    """
    from deepspeed_ext.engine.rng import get_rng_state
    from deepspeed_ext.format.objects import encode
    _, rng_tensors = encode({"rng": get_rng_state()})
    rng_bytes = sum(t.numel() * t.element_size() for t in rng_tensors.values())
    nbytes = slot_bytes(fragments, rng_bytes, place.world)
    ok, error, seconds = True, None, 0.0
    try:
        seconds = place.slots.prepare(nbytes)
    except OSError as e:
        ok, error = False, (f"rank {place.rank}: preparing {place.num_slots} snapshot slots of "
                            f"{nbytes / 2**20:.1f} MiB under {place.node_dir}: {e} (point "
                            f"--moc-shm-dir at a larger shared-memory filesystem)")
    raise_if_failed(all_outcomes(ok, error), "MoC snapshot slots")
    _log(f"two-level checkpointing: {place.num_slots} snapshot slots of "
         f"{nbytes / 2**20:.1f} MiB per rank ready in {seconds:.3f} s (allocated, mapped"
         + (", page-locked" if place.copier.cuda else "") + ")")
    return seconds
