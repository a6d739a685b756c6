"""etrain: elastic transformer training on Ray. The package's folders are its layers, each importing only those
below it (tests/test_layers.py holds them):

    cli/           the command line            driver/   the driver's side of a job, the Python API, reports
    tune/          hyper-parameter search      control/  the coordinator and what its loop sequences (Ray actors)
    worker/        the training worker and its engines, and the protocol both sides share
    data/          preparing, sharding, ordering and streaming the data
    core/          the ground: config, models, checkpoints, records, parallel layouts
"""
