"""`from superneurons.proto import caffe_pb2`: pycaffe's name for the schema's messages (Datum, NetParameter,
BlobProto, ...), which superneurons_pb2 holds under the same names and field numbers as Caffe's."""
from superneurons.proto.superneurons_pb2 import *  # noqa: F401,F403
