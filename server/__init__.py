"""The OpenAI-compatible HTTP server (``app``, ``protocol``) and the `kvserve` command (``cli``).

It may import engine, models and kernels; never bench, whose commands `kvserve` finds through
the ``kvserve.commands`` entry points.
"""
