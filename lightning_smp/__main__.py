"""``python -m lightning_smp fit --config FILE``: the same as the ``lightning-smp`` console script."""

from lightning_smp.cli import main

if __name__ == "__main__":
    main()
