"""Boundaries of :mod:`deepspeed_ext.store.pins` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/store``)."""

import uuid

from deepspeed_ext.store.pins import RetentionProbe, reading


def test_a_pin_holds_its_own_tag_and_no_other(tmp_path):
    with reading(str(tmp_path), "global_step10"):
        probe = RetentionProbe(str(tmp_path))
        try:
            assert probe.fd is not None   # the readers' file exists: the byte locks count
            assert not probe.claim("global_step10")
            assert probe.claim("global_step20")
        finally:
            probe.close()


def test_nested_pins_of_one_tag_hold_it_until_the_outer_one_ends():
    # On a URL there is no readers' file: this process's count alone holds the tag.
    save_dir = f"memory://moc-test-{uuid.uuid4().hex[:10]}/ckpt"
    probe = RetentionProbe(save_dir)
    with reading(save_dir, "global_step10"):
        with reading(save_dir, "global_step10"):
            assert not probe.claim("global_step10")
        assert not probe.claim("global_step10")
        assert probe.claim("global_step20")
    assert probe.claim("global_step10")
