"""Stand-in for the deprecated IpuOptions API of `tensorflow.python.ipu.utils` (Graphcore's
TensorFlow up to SDK 2.3; graphcore/tensorflow removed it in "Remove deprecated things for
SDK 2.4"), written from that source: `create_ipu_config()` makes an IpuOptions protobuf, and
`select_ipus(opts, indices)` and `set_experimental_multi_replica_distribution_options(opts,
process_count, process_index)` return the updated options. A dict stands in for the protobuf,
copied on every call, so that a caller ignoring the returned options gets caught.
"""


def create_ipu_config():
    return {"device_config": [], "process_count": 0, "process_index": 0}


def select_ipus(opts, indices):
    return dict(opts, device_config=list(indices))


def set_experimental_multi_replica_distribution_options(opts, process_count, process_index):
    return dict(opts, process_count=process_count, process_index=process_index)
