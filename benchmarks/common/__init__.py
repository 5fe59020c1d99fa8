"""The floor every study stands on; it imports no study.

* ``runner``: training runs as processes (``Run``, ``execute_all``), their logs and meta files;
* ``codecs``: the codecs the studies run (``CODECS``), ``codec_rows``: the codec tables' rows;
* ``stats``: the one Student-t quantile; ``score``: steps to a loss, equivalent steps, paired intervals;
* ``pages``: a page's JSON beside it and its measured blocks;
* ``real_activations``: real models' hidden states; ``energy``: a message's top-k energy share.
"""
