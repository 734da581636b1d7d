"""Tandem engine: model forward over a paged block pool, one worker process per device.

The tensor side only: it imports nothing from sched/, cache/ or server/; ``engine.messages`` is
the torch-free vocabulary the layers above use to talk to it."""
