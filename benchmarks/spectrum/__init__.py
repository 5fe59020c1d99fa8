"""When lowrank helps: the energy share of messages' top directions along training (``python -m benchmarks.spectrum``;
``hook``: the stage that records them)."""
