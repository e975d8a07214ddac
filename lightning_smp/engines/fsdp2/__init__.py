"""The FSDP2 engine (``fully_shard``): the class (:mod:`.engine`), its planner rules (:mod:`.prediction`), the
arguments it takes (:mod:`.options`), wrapping (:mod:`.wrap`), gradient accumulation (:mod:`.accumulation`), full
state dicts (:mod:`.state_dicts`), and the reads of FSDP2's parameter groups (:mod:`.groups`, :mod:`.unused`)."""
