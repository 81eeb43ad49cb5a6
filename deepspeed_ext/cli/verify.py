"""``moc-ckpt verify``: check files, checksums, coverage and the expert index of one or
every checkpoint, and that ``latest`` names a complete one (exit 1 on any problem).

Each checkpoint is verified under a reader's pin (:func:`deepspeed_ext.store.pins.reading`),
so a committer's retention running meanwhile does not delete it halfway.
"""

import argparse
import os
from typing import List, Optional, Tuple

from deepspeed_ext.cli.common import UsageError, check_dir, check_tag_dir
from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.manifest import MANIFEST_FILE
from deepspeed_ext.format.naming import LATEST_FILE
from deepspeed_ext.store.catalog import scan_checkpoints
from deepspeed_ext.store.latest import read_latest
from deepspeed_ext.store.pins import reading
from deepspeed_ext.store.verify import verify_checkpoint


LATEST_READS = 5
"""How often ``moc-ckpt verify`` reads ``latest`` before it calls a ``latest`` naming no
complete checkpoint a problem (each read after the first follows a commit that moved it)."""


def _verify_pinned(save_dir: str, tag: str, checksums: bool) -> Optional[List[str]]:
    """Problems of checkpoint ``tag``, verified under a pin that keeps retention off it
    (:func:`deepspeed_ext.store.pins.reading`); None when it has no manifest once pinned (a
    committer's retention deleted it since it was listed: not damage)."""
    with reading(save_dir, tag):
        if not fs.exists(os.path.join(save_dir, tag, MANIFEST_FILE)):
            return None
        return verify_checkpoint(save_dir, tag, checksums)


def _verify_latest(save_dir: str, verified: set, checksums: bool,
                   results: List[Tuple[str, List[str]]]) -> None:
    """Check that ``latest`` names a complete checkpoint, verifying it when the listing
    did not hold it (committed since).

    A committer (a keeper, possibly finishing the persists of a job that died) moves
    ``latest`` only after the new manifest, and retention deletes only what ``latest``
    does not name, both under the directory's lock; this reader takes no lock. So a
    ``latest`` naming a tag that has no manifest when looked at was read just before a
    commit moved it and retention removed the old tag: ``latest`` is read again, and only
    a tag that lacks a manifest on two reads in a row is a problem. The listing taken at
    the start is not trusted for it: a commit landing while the checkpoints were checksummed
    made ``latest`` name a tag the listing lacked, reported as damage.
    """
    path = os.path.join(save_dir, LATEST_FILE)
    previous = None
    for _ in range(LATEST_READS):
        try:
            latest = read_latest(save_dir)
        except CheckpointError as err:
            results.append(("latest", [str(err)]))
            return
        if latest is None or latest in verified:
            return
        problems = _verify_pinned(save_dir, latest, checksums)
        if problems is not None:
            results.append((latest, problems))
            verified.add(latest)
            return
        if latest == previous:
            break
        previous = latest
    results.append(("latest", [f"{path} names {latest!r}, which is not a complete checkpoint"]))


def cmd_verify(args: argparse.Namespace) -> int:
    """``moc-ckpt verify DIR [--tag T] [--no-checksums]`` (run by
    :func:`deepspeed_ext.cli.main.main`): 1 if any checkpoint or ``latest`` has a problem."""
    check_dir(args.dir)
    check_tag_dir(args.dir, args.tag)
    checksums = not args.no_checksums
    results: List[Tuple[str, List[str]]] = []
    if args.tag is not None:
        with reading(args.dir, args.tag):
            results.append((args.tag, verify_checkpoint(args.dir, args.tag, checksums)))
    else:
        scan = scan_checkpoints(args.dir)
        if not scan.complete and not scan.corrupt:
            raise UsageError(f"no complete checkpoint in {args.dir}")
        verified, gone = set(), []
        for _, tag in scan.complete:
            problems = _verify_pinned(args.dir, tag, checksums)
            if problems is None:
                gone.append(tag)
                continue
            results.append((tag, problems))
            verified.add(tag)
        for tag, err in scan.corrupt:
            results.append((tag, [err]))
        _verify_latest(args.dir, verified, checksums, results)
        if gone:
            print(f"not verified, removed by retention while verifying: {', '.join(gone)}")
        if scan.incomplete:
            print(f"not verified, incomplete (no {MANIFEST_FILE}): {', '.join(scan.incomplete)}")
    failed = 0
    for tag, problems in results:
        if problems:
            failed += 1
            print(f"FAILED {tag}")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"OK     {tag}")
    if failed:
        print(f"{failed} of {len(results)} failed")
    return 1 if failed else 0
