"""How a place commits a write is its own: a new directory appears whole or not at all, on a local file system (a
hidden directory renamed into place) and on an object store (written in place, whole once sealed), and what an
interrupted write left is named for removal."""

import pytest

from ignite_zero.storage.places import Place, place_of

SEAL = "seal.json"


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path) -> Place:
    if request.param == "local":
        return place_of(tmp_path / "run")
    bucket = request.getfixturevalue("bucket")  # moto's S3 server on 127.0.0.1
    return place_of(f"{bucket}/run", request.getfixturevalue("storage_options"))


def _write(place: Place, name: str, content: bytes) -> None:
    place.write(name, lambda f: f.write(content), atomic=False)


def _seal(written: Place) -> None:
    written.write(SEAL, lambda f: f.write(b"{}"))


def test_a_directory_appears_whole_at_its_commit(place):
    place.make()
    written = place.begin_directory("ckpt.dcp")
    assert str(written) == str(place.writing_directory("ckpt.dcp"))
    _write(written, "part_0", b"abc")
    # before the commit, nothing under the name is whole, and the begun directory is a leftover if abandoned
    assert not (place.child("ckpt.dcp").exists() and place.child("ckpt.dcp").is_whole(SEAL))
    assert place.leftovers(place.entries()) != []

    place.commit_directory("ckpt.dcp", _seal)
    committed = place.child("ckpt.dcp")
    assert committed.is_whole(SEAL)
    assert committed.read("part_0") == b"abc" and committed.is_file(SEAL)
    assert place.leftovers(place.entries()) == []


def test_a_constant_name_is_replaced_by_the_commit(place):
    place.make()
    for content in (b"old", b"new"):
        written = place.begin_directory("latest.dcp")
        _write(written, "part_0", content)
        place.commit_directory("latest.dcp", _seal)
    assert place.child("latest.dcp").read("part_0") == b"new"
    assert place.leftovers(place.entries()) == []


def test_leftovers_are_temporaries_and_unfinished_directories_only(place):
    place.make()
    _write(place, "model_1.pt", b"kept")
    place.write(".model_2.pt.ignite_zero-0123abcd.tmp", lambda f: f.write(b"left"), atomic=False)
    other = place.child("other_tool.dcp")  # another tool's directory: never taken for a leftover of ours
    other.make()
    _write(other, ".metadata", b"x")
    place.begin_directory("interrupted.dcp")
    _write(place.writing_directory("interrupted.dcp"), "part_0", b"x")

    left = place.leftovers(place.entries())
    assert ".model_2.pt.ignite_zero-0123abcd.tmp" in left
    assert "model_1.pt" not in left and "other_tool.dcp" not in left
    assert any("interrupted.dcp" in name for name in left)

    # what this process is writing now is no leftover
    assert place.leftovers(place.entries(), writing={"model_2.pt", "interrupted.dcp"}) == []


def test_aborting_uploads_leaves_those_being_written(bucket, storage_options):
    place = place_of(f"{bucket}/run", storage_options)
    place.make()
    client, name = place.fs, bucket.removeprefix("s3://")
    keys = ["run/first_1.pt", "run/first.dcp/__0_0.distcp", "run/.second_1.pt.ignite_zero-0123abcd.tmp"]
    keys += ["run/second_1.pt", "run/second.dcp/__1_0.distcp", "elsewhere/first_1.pt"]
    for key in keys:
        client.call_s3("create_multipart_upload", Bucket=name, Key=key)

    aborted = place.abort_uploads(writing={"first_1.pt", "first.dcp"})
    assert sorted(aborted) == sorted(f"{name}/{key}" for key in keys[2:5])
    left = client.call_s3("list_multipart_uploads", Bucket=name).get("Uploads", [])
    assert sorted(upload["Key"] for upload in left) == sorted(["elsewhere/first_1.pt", *keys[:2]])
