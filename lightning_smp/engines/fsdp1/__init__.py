"""The FSDP1 engine (``FullyShardedDataParallel``): the class (:mod:`.engine`), its planner rules (:mod:`.prediction`),
flat-parameter arithmetic (:mod:`.flat`), and the modules that read FSDP1's internals, one job each (:mod:`.state`,
:mod:`.unused`, :mod:`.left_out`, :mod:`.clip`)."""
