"""Write a root file system folder as a Docker image archive of one architecture (docker load).

    python3 scripts/rootfs_image.py ROOTFS ARCH TAG OUT.tar

ROOTFS is a folder holding a whole root file system (a debootstrap'd Debian with python3),
ARCH the image's architecture (``amd64``, ``arm64``), TAG its name, OUT the archive written.
Runs with the system's python3 alone (no venv needed): scripts/prepare-docker-offline.sh uses it
to make the offline base image when no registry can be reached.
"""

import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def write_layer(rootfs: str, layer: str) -> str:
    """Tar every entry of ``rootfs`` (sorted) into ``layer``; its sha256 (the layer's id)."""
    with tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(os.listdir(rootfs)):
            tar.add(os.path.join(rootfs, name), arcname=name)
    digest = hashlib.sha256()
    with open(layer, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def image_config(arch: str, layer_id: str) -> bytes:
    """The image's config: its platform, environment, command and one layer."""
    config: dict[str, object] = {
        "architecture": arch, "os": "linux",
        "config": {"Env": [f"PATH={PATH}", "LANG=C.UTF-8"], "Cmd": ["python3"]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + layer_id]},
        "history": [{"comment": "debootstrap minbase bookworm + python3"}]}
    if arch == "arm64":
        config["variant"] = "v8"
    return json.dumps(config).encode()


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def main() -> None:
    rootfs, arch, tag, out = sys.argv[1:5]
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out) or ".") as tmp:
        layer = os.path.join(tmp, "layer.tar")
        config = image_config(arch, write_layer(rootfs, layer))
        config_name = hashlib.sha256(config).hexdigest() + ".json"
        manifest = [{"Config": config_name, "RepoTags": [tag], "Layers": ["layer.tar"]}]
        with tarfile.open(out, "w") as tar:
            add_bytes(tar, config_name, config)
            add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
            tar.add(layer, arcname="layer.tar")


if __name__ == "__main__":
    main()
