"""What the Trainer and the Fabric strategies share, once, each concern in its own module: :mod:`.shared`
(:class:`HybridShardFrontEnd`: the public properties, start-up steps and messages, sharding, the registration of the
strategy names), :mod:`.degree_choice` (``hybrid_shard_degree="auto"``), :mod:`.replica_groups`
(``fault_tolerance``), :mod:`.background_saves` (``async_save``), :mod:`.signatures` (:func:`with_options`: each
constructor's signature and docstring from the options' declarations)."""

from lightning_smp.frontend.shared import HybridShardFrontEnd
from lightning_smp.frontend.signatures import OPTIONS_LINE, with_options

__all__ = ["OPTIONS_LINE", "HybridShardFrontEnd", "with_options"]
