"""The test suite, laid out like the package (codecs/, kernels/, link/, megatron/), the studies (studies/) and the
repository (project/); helpers/ holds what several tests share. A package: tests import as ``tests.<folder>.<module>``
(pytest's rootdir on ``sys.path``), so two folders may each hold a ``test_<module>.py`` of the same name."""
