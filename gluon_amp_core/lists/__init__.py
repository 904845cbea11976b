"""Op-class data, one module per target dtype. See ``gluon_amp.table`` for the rules."""
