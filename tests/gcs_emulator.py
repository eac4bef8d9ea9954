"""`python tests/gcs_emulator.py start ...`: gcp-storage-emulator, plus the x-goog-generation header on downloads.

Real GCS sends an object's generation with its content; tensorstore (orbax's array writer) reads it from there to
do OCDBT's conditional manifest updates, and the emulator does not send it ("Malformed StorageGeneration").
"""

import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # noqa: BLE001 - not found: the emulator's own handler answers 404
        obj = None
    if obj:
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    return _download(request, response, storage, *args, **kwargs)


objects.download = download

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main

    sys.exit(main(sys.argv[1:]))
