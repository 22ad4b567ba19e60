"""Write a root file system folder as a Docker image archive of a given architecture (docker load)."""
import hashlib, io, json, sys, tarfile, tempfile, os
rootfs, arch, tag, out = sys.argv[1:5]
with tempfile.TemporaryDirectory(dir=os.path.dirname(out) or ".") as tmp:
    layer = os.path.join(tmp, "layer.tar")
    with tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as t:
        for name in sorted(os.listdir(rootfs)):
            t.add(os.path.join(rootfs, name), arcname=name)
    h = hashlib.sha256()
    with open(layer, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    config = {"architecture": arch, "os": "linux",
              "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"], "Cmd": ["python3"]},
              "rootfs": {"type": "layers", "diff_ids": ["sha256:" + h.hexdigest()]},
              "history": [{"comment": "debootstrap minbase bookworm + python3"}]}
    if arch == "arm64":
        config["variant"] = "v8"
    blob = json.dumps(config).encode()
    cfg_name = hashlib.sha256(blob).hexdigest() + ".json"
    manifest = json.dumps([{"Config": cfg_name, "RepoTags": [tag], "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(out, "w") as t:
        for name, data in ((cfg_name, blob), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name); info.size = len(data); t.addfile(info, io.BytesIO(data))
        t.add(layer, arcname="layer.tar")
