"""The one exception type of the package."""


class HybridShardConfigError(ValueError):
    """A configuration value that hybrid sharding cannot use.

    Every message names the parameter, the value it got and what would be valid. It subclasses
    ``ValueError`` so that code catching bad arguments the usual way keeps working.
    """
