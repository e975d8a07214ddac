"""The DDP engine (``DistributedDataParallel``, every layout with nothing sharded): the class (:mod:`.engine`) and
its planner rules (:mod:`.prediction`)."""
