"""kvserve's client side: the load tester (`kvserve bench`), its plots, the policy tuner
(`kvserve tune`), and the engine and kernel benchmarks; their results live in bench/results/.

It may import every other package (kernels, models, engine, server): the tuner serves an engine
in-process. Nothing imports bench; `kvserve` finds its commands through entry points.
Installed with the ``bench`` extra (``pip install 'kvserve[bench]'``).
"""
