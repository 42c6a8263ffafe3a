//! The source's shape, as `docs/src/development.md` ("Layout") promises it: no two files import
//! each other around a circle (counted by `scripts/import-circles.py`, which is tested here on
//! small crates it must find circles in), and `src/` is the dozen entries the crate's map in
//! `src/lib.rs` names.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the circle count with `--check` over `src`: (passed, its output).
fn count_circles(src: &Path) -> (bool, String) {
    let out = Command::new("python3")
        .arg(root().join("scripts/import-circles.py"))
        .arg("--check")
        .arg(src)
        .output()
        .expect("python3 runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A small crate: `files` as (path under src/, text).
fn crate_of(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for (path, text) in files {
        let path = dir.path().join("src").join(path);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("dirs");
        std::fs::write(path, text).expect("write");
    }
    dir
}

#[test]
fn no_source_file_is_in_an_import_circle() {
    let (passed, out) = count_circles(&root().join("src"));
    assert!(passed, "import circles in src/:\n{out}");
    let summary = out.lines().next().unwrap_or_default();
    assert!(
        summary.ends_with(", 0 circle(s)"),
        "unexpected summary: {summary}"
    );
    // The count reads the real tree: over a hundred files and their edges.
    let files: usize = summary
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(files > 100, "only {files} files counted: {summary}");
}

#[test]
fn the_circle_count_finds_each_way_of_closing_a_circle() {
    // Two files importing each other with `use`.
    let used = crate_of(&[
        ("lib.rs", "pub mod a;\npub mod b;\n"),
        (
            "a.rs",
            "use crate::b::B;\npub struct A(pub Option<Box<B>>);\n",
        ),
        (
            "b.rs",
            "use crate::a::A;\npub struct B(pub Option<Box<A>>);\n",
        ),
    ]);
    let (passed, out) = count_circles(&used.path().join("src"));
    assert!(!passed);
    assert!(
        out.starts_with("3 files, 2 import edges, 1 circle(s)\n"),
        "{out}"
    );
    assert!(
        out.contains("circle of 2 files: src/a.rs, src/b.rs"),
        "{out}"
    );

    // A child naming its parent's item while the parent names the child's, through paths in
    // code (no `use`); test code is left out.
    let nested = crate_of(&[
        ("lib.rs", "pub mod m;\n"),
        (
            "m/mod.rs",
            "pub mod child;\npub struct Parent;\npub fn f() -> child::Child { child::Child }\n",
        ),
        (
            "m/child.rs",
            "pub struct Child;\npub fn g() -> super::Parent { super::Parent }\n",
        ),
    ]);
    let (passed, out) = count_circles(&nested.path().join("src"));
    assert!(!passed);
    assert!(
        out.contains("circle of 2 files: src/m/child.rs, src/m/mod.rs"),
        "{out}"
    );

    // The same child importing from a sibling instead: no circle; a test module's imports
    // and a comment's path do not count.
    let fixed = crate_of(&[
        ("lib.rs", "pub mod m;\n"),
        (
            "m/mod.rs",
            "pub mod child;\npub mod parent;\npub fn f() -> child::Child { child::Child }\n",
        ),
        ("m/parent.rs", "pub struct Parent;\n"),
        (
            "m/child.rs",
            "// super::f() is not called\npub struct Child;\npub fn g() -> super::parent::Parent { super::parent::Parent }\n#[cfg(test)]\nmod tests {\n    use super::super::f;\n}\n",
        ),
    ]);
    let (passed, out) = count_circles(&fixed.path().join("src"));
    assert!(passed, "{out}");
    assert!(
        out.starts_with("4 files, 2 import edges, 0 circle(s)"),
        "{out}"
    );
}

#[test]
fn src_lists_the_folders_the_crate_map_names() {
    let mut entries: Vec<String> = std::fs::read_dir(root().join("src"))
        .expect("src")
        .map(|e| {
            let e = e.expect("entry");
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() {
                format!("{name}/")
            } else {
                name
            }
        })
        .collect();
    entries.sort();
    assert!(
        entries.len() <= 13,
        "src/ lists {}: {entries:?}",
        entries.len()
    );
    let map = std::fs::read_to_string(root().join("src/lib.rs")).expect("lib.rs");
    let layout =
        std::fs::read_to_string(root().join("docs/src/development.md")).expect("development.md");
    for entry in entries.iter().filter(|e| e.ends_with('/')) {
        assert!(
            map.lines().any(|l| l.starts_with(&format!("//! {entry} "))),
            "src/lib.rs's map does not name {entry}"
        );
        assert!(
            layout.contains(&format!("\nsrc/{entry} ")),
            "development.md's Layout does not list src/{entry}"
        );
    }
}
