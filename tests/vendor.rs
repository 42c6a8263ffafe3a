//! The Pingora crates carried under `vendor/` are their crates.io releases plus exactly the
//! patches `vendor/README.md` lists (`scripts/vendor-check.sh`, offline, against the `.crate`
//! files `scripts/test.sh` downloads with `--fetch` and checks against the README's sha256).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn check(vendor: Option<&Path>) -> Output {
    let mut cmd = Command::new("bash");
    cmd.arg(root().join("scripts/vendor-check.sh"));
    if let Some(vendor) = vendor {
        cmd.arg(vendor);
    }
    cmd.output().expect("bash runs")
}

#[test]
fn vendor_is_the_release_plus_exactly_the_listed_patches() {
    let out = check(None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout,
        "vendor/pingora-core: pingora-core 0.9.1 from crates.io + 7 listed patch(es), nothing else\n\
         vendor/pingora-http: pingora-http 0.9.1 from crates.io + 4 listed patch(es), nothing else\n"
    );
}

#[test]
fn an_edit_outside_the_patches_is_found() {
    // A copy of vendor/ with one line of pingora-http changed that no patch changes.
    let copy = tempfile::tempdir().unwrap();
    let status = Command::new("cp")
        .arg("-r")
        .arg(root().join("vendor/pingora-core"))
        .arg(root().join("vendor/pingora-http"))
        .arg(copy.path())
        .status()
        .unwrap();
    assert!(status.success());
    let lib = copy.path().join("pingora-http/src/lib.rs");
    let text = std::fs::read_to_string(&lib).unwrap();
    std::fs::write(&lib, format!("{text}// an edit\n")).unwrap();

    let out = check(Some(copy.path()));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("vendor-check: vendor/pingora-http differs from pingora-http 0.9.1 + its listed patches:"),
        "{stderr}"
    );
    assert!(stderr.contains("pingora-http/src/lib.rs"), "{stderr}");
    // The untouched crate still passes.
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("vendor/pingora-core: pingora-core 0.9.1"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
