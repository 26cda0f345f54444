"""A local Google Cloud Storage (`gcp-storage-emulator`, in memory) for the `gs://` tests.

    python -m tests.train.gcs_emulator PORT BUCKET

Serves on 127.0.0.1:PORT with BUCKET created. One fidelity fix: GCS answers every media download
with the object's `x-goog-generation` (and `x-goog-metageneration`) headers (the XML API
reference headers, which the JSON API's `alt=media` responses carry as well); the emulator
(2026.7.19) sends none. Tensorstore's gcs driver reads an object's generation from that header
and its OCDBT manifest (Orbax's default layout) refuses a read without one ("Malformed
StorageGeneration"), so the downloads here add them from the object's own metadata.

And one robustness fix: the emulator serves one request at a time, and a client killed mid-upload
(the SIGKILL of the test) would hold it forever waiting for the rest of the body; a 10 s socket
timeout per request drops such a connection, as a real server does.
"""

import sys

from gcp_storage_emulator import server
from gcp_storage_emulator.handlers import objects

_download = objects.download


def download_with_generation(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    if response.status.value in (200, 206):
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])


def main(port: int, bucket: str):
    server.RequestHandler.timeout = 10  # StreamRequestHandler: socket timeout for each connection
    objects.download = download_with_generation  # objects.get calls it for `alt=media`
    for _, handlers in server.HANDLERS:  # the routes that name it directly
        for method, handler in handlers.items():
            if handler is _download:
                handlers[method] = download_with_generation
    server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket).run()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
