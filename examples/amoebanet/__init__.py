"""AmoebaNet-D on CIFAR-10 (or ImageNet) trained with the GPipe strategy.

The package is not installed: ``train.py`` and the tests put ``examples/`` on
``sys.path`` and import ``amoebanet.<module>``.
"""
