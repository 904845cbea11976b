"""Op-class data, one module per target dtype. See :mod:`gluon_amp_core.table` for the rules."""
