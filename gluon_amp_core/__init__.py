"""gluon_amp's pure core: op lists, table, policy, dtype decision, graph walk and pass,
capability model and loss-scale state. Needs no MXNet and no NumPy; importing it does
nothing else. ``gluon_amp`` adapts it to MXNet."""
