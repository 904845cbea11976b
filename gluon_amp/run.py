"""``python -m gluon_amp.run [options] SCRIPT [ARGS...]`` (or ``-m MODULE [ARGS...]``): run code
you do not own under gluon_amp, as ``python -m coverage run`` runs it under coverage.

``python -m gluon_amp.run --help`` lists the options; :mod:`gluon_amp.launch.cli` does the work.
"""
if __name__ == "__main__":
    from gluon_amp.launch.cli import main

    main()
