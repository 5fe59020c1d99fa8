"""Imported first by the multi-process harness's fork server (``dist_utils.SERVER_PRELOAD``): the server gets SIGKILL
when its parent, the test process, dies -- also while it is still importing megatron-core, before it would notice
its parent's end by itself."""

from tests.helpers.rank_entry import die_with_parent

die_with_parent()
