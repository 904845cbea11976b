"""What gluon_amp tells the user: the precision report of a graph, and ``runtime_info()``."""
