"""Savers: where and when a checkpoint is written, behind one protocol (:mod:`ignite_zero.storage.savers.base`).

==================  ==================================================================================
``base``            the protocol: :class:`~ignite_zero.storage.savers.base.Saver`, its ``SaveRequest``
``destination``     what the local savers share: the directory, the writing rank, names, retention
``disk``            :class:`~ignite_zero.DiskSaver`: one durable file per checkpoint
``consolidated``    savers that gather the full state on the recipient, then write it in one piece
``sharded``         :class:`~ignite_zero.ShardedSaver`: a DCP directory that every rank writes its part of
``sharded_commit``  one collective sharded save, phase by phase: prepare, write, check, seal, clean
``ignite_handler``  any other ignite handler, called as ignite calls it
``background``      asynchronous saves: the copy that blocks training, the write in a thread of its own
==================  ==================================================================================
"""
