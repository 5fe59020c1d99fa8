"""Imported first by the multi-process harness's fork server (``dist_utils.SERVER_PRELOAD``): the server gets SIGKILL
when its parent, the test process, dies -- also while it is still importing megatron-core, before it would notice
its parent's end by itself. A parent that died before the signal was set (the server's interpreter starting up
under load) is seen here: the server's parent is no longer the one that started it (``PARENT_VARIABLE``), and it
exits at once."""

import os

from tests.helpers.rank_entry import PARENT_VARIABLE, die_with_parent

die_with_parent()
if os.environ.get(PARENT_VARIABLE) not in (None, str(os.getppid())):
    os._exit(0)
