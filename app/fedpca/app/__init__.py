"""Application wiring on top of the roles: the ``fedpca`` command line, the loopback
cluster used by the demo, tests and benchmarks, and the demo itself.

Dependency rule: ``fedpca.app`` may import the kernel and every role; nothing in the
kernel or the roles imports ``fedpca.app``.
"""
