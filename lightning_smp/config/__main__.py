"""``python -m lightning_smp.config``: rewrite the strategies' constructor parameters for the options, from their
declarations (:func:`lightning_smp.config.options.main`), after an option is added or changed."""

from lightning_smp.config.options import main

main()
