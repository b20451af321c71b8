"""Loading: objects restored from a checkpoint's entries, on any world size.

=============  ===============================================================================================
``objects``    a checkpoint read where it can be, each rank given what it needs, every object restored or none
``entries``    which entries of a checkpoint each object loads, as the adapters say what each object needs
``whole``      a checkpoint's whole state as one file holds it (optimizer state keyed by index again)
``latest``     the newest complete, verified checkpoint in one place or several, agreed by every rank
``resume``     the checkpoints a resumed handler keeps once the newest valid one is loaded
=============  ===============================================================================================
"""
