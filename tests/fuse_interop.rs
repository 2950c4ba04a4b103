//! Interoperability with `weed mount` 4.48 and the filer HTTP API on the same filer path at the
//! same time: what we write they read identically, and what they write we read within seconds
//! without a remount (the metadata subscription invalidates our caches and the kernel's).

mod common;
mod fuse_support;

use fuse_support::*;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::Duration;

const SOON: Duration = Duration::from_secs(15);

fn eventually(what: &str, f: impl FnMut() -> bool) {
    assert!(wait_until(SOON, f), "{what}: not seen within {SOON:?}");
}

fn assert_reads(what: &str, p: &Path, want: &[u8]) {
    let got = eventually_reads(p, SOON, |b| b == want);
    assert!(
        got.is_some(),
        "{what}: {} does not read the expected {} bytes (has {:?} bytes)",
        p.display(),
        want.len(),
        fs::read(p).ok().map(|b| b.len())
    );
}

#[test]
fn what_we_write_weed_mount_and_http_read() {
    let w = shared_server();
    let root = unique_path("ours2weed");
    let ours = mount_ours(&w, &root, &[]);
    let weed = mount_weed(&w, &root);
    let http = |p: &str| w.filer_get(&format!("{root}/{p}"));

    let small = b"small file written by us\n".to_vec();
    let big = pseudo_random(11, 5 * (1 << 20) + 333);
    fs::write(ours.join("small.txt"), &small).unwrap();
    fs::write(ours.join("big.bin"), &big).unwrap();
    fs::create_dir_all(ours.join("dir/sub")).unwrap();
    fs::write(ours.join("dir/sub/nested"), b"nested").unwrap();
    std::os::unix::fs::symlink("small.txt", ours.join("link")).unwrap();
    fs::set_permissions(ours.join("small.txt"), fs::Permissions::from_mode(0o640)).unwrap();
    setxattr(&ours.join("small.txt"), "user.origin", b"ours", 0).unwrap();
    // random overwrites and a truncate of a multi-chunk file
    let f = OpenOptions::new()
        .write(true)
        .open(ours.join("big.bin"))
        .unwrap();
    let mut big2 = big.clone();
    for (i, off) in [10usize, 2_000_000, 4_194_300].iter().enumerate() {
        let patch = pseudo_random(100 + i as u64, 5000);
        f.write_all_at(&patch, *off as u64).unwrap();
        big2[*off..off + 5000].copy_from_slice(&patch);
    }
    f.set_len(3_000_001).unwrap();
    big2.truncate(3_000_001);
    drop(f);

    for (name, want) in [("small.txt", &small), ("big.bin", &big2)] {
        assert_eq!(&http(name).unwrap(), want, "{name} via filer HTTP");
        assert_reads(&format!("{name} via weed mount"), &weed.join(name), want);
    }
    assert_reads(
        "nested via weed mount",
        &weed.join("dir/sub/nested"),
        b"nested",
    );
    assert_eq!(http("dir/sub/nested").unwrap(), b"nested");
    eventually("symlink on weed mount", || {
        fs::read_link(weed.join("link"))
            .map(|t| t.to_str() == Some("small.txt"))
            .unwrap_or(false)
    });
    let md = fs::metadata(weed.join("small.txt")).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o640);
    assert_eq!(
        getxattr(&weed.join("small.txt"), "user.origin")
            .ok()
            .as_deref(),
        Some(&b"ours"[..])
    );
    // same inode numbers on both mounts (both use the filer's)
    assert_eq!(
        fs::metadata(ours.join("big.bin")).unwrap().ino(),
        fs::metadata(weed.join("big.bin")).unwrap().ino()
    );

    // later changes from us reach a weed mount that already cached the file
    let mut f = OpenOptions::new()
        .append(true)
        .open(ours.join("small.txt"))
        .unwrap();
    f.write_all(b"appended by us\n").unwrap();
    drop(f);
    let mut small2 = small.clone();
    small2.extend_from_slice(b"appended by us\n");
    assert_reads("append via weed mount", &weed.join("small.txt"), &small2);
    fs::rename(ours.join("dir"), ours.join("dir2")).unwrap();
    assert_reads(
        "renamed dir via weed mount",
        &weed.join("dir2/sub/nested"),
        b"nested",
    );
    eventually("old dir gone on weed mount", || !weed.join("dir").exists());
    fs::remove_file(ours.join("big.bin")).unwrap();
    eventually("deleted on weed mount", || !weed.join("big.bin").exists());
    assert!(http("big.bin").is_none());
}

#[test]
fn what_weed_mount_and_http_write_we_read() {
    let w = shared_server();
    let root = unique_path("weed2ours");
    let ours = mount_ours(&w, &root, &[]);
    let weed = mount_weed(&w, &root);

    // new files and directories from weed mount
    let data = pseudo_random(21, 3 * (1 << 20) + 5);
    fs::write(weed.join("from_weed.bin"), &data).unwrap();
    fs::create_dir(weed.join("wdir")).unwrap();
    fs::write(weed.join("wdir/f"), b"in wdir").unwrap();
    assert_reads("weed file", &ours.join("from_weed.bin"), &data);
    assert_reads("weed nested", &ours.join("wdir/f"), b"in wdir");
    // a directory's link count follows subdirectories made elsewhere (kernel attrs dropped)
    assert_eq!(fs::metadata(ours.join("wdir")).unwrap().nlink(), 2);
    fs::create_dir(weed.join("wdir/sub")).unwrap();
    eventually("nlink after mkdir by weed", || {
        fs::metadata(ours.join("wdir"))
            .map(|m| m.nlink())
            .unwrap_or(0)
            == 3
    });
    fs::remove_dir(weed.join("wdir/sub")).unwrap();
    eventually("nlink after rmdir by weed", || {
        fs::metadata(ours.join("wdir"))
            .map(|m| m.nlink())
            .unwrap_or(0)
            == 2
    });
    // ...also when the filer creates the subdirectory itself (HTTP upload into a new path)
    w.filer_put(&format!("{root}/wdir/auto/file"), b"auto", "");
    eventually("nlink after an HTTP upload made a directory", || {
        fs::metadata(ours.join("wdir"))
            .map(|m| m.nlink())
            .unwrap_or(0)
            == 3
    });
    assert_reads("auto-created path", &ours.join("wdir/auto/file"), b"auto");

    // an overwrite of a file we have read (and cached) shows without a remount
    let v2 = pseudo_random(22, data.len());
    fs::write(weed.join("from_weed.bin"), &v2).unwrap();
    assert_reads("overwritten by weed", &ours.join("from_weed.bin"), &v2);
    // growing and shrinking
    let mut f = OpenOptions::new()
        .append(true)
        .open(weed.join("from_weed.bin"))
        .unwrap();
    f.write_all(b"tail").unwrap();
    drop(f);
    let mut v3 = v2.clone();
    v3.extend_from_slice(b"tail");
    assert_reads("appended by weed", &ours.join("from_weed.bin"), &v3);
    eventually("size after append", || {
        fs::metadata(ours.join("from_weed.bin"))
            .map(|m| m.len() == v3.len() as u64)
            .unwrap_or(false)
    });
    fs::write(weed.join("from_weed.bin"), b"short").unwrap();
    assert_reads("shrunk by weed", &ours.join("from_weed.bin"), b"short");

    // attributes and xattrs
    fs::set_permissions(weed.join("wdir/f"), fs::Permissions::from_mode(0o600)).unwrap();
    eventually("chmod by weed", || {
        fs::metadata(ours.join("wdir/f"))
            .map(|m| m.mode() & 0o7777 == 0o600)
            .unwrap_or(false)
    });
    setxattr(&weed.join("wdir/f"), "user.origin", b"weed", 0).unwrap();
    eventually("xattr by weed", || {
        getxattr(&ours.join("wdir/f"), "user.origin")
            .ok()
            .as_deref()
            == Some(&b"weed"[..])
    });

    // rename and delete
    fs::rename(weed.join("wdir"), weed.join("wdir2")).unwrap();
    assert_reads("renamed by weed", &ours.join("wdir2/f"), b"in wdir");
    eventually("old name gone", || !ours.join("wdir").exists());
    fs::remove_file(weed.join("from_weed.bin")).unwrap();
    eventually("deleted by weed", || !ours.join("from_weed.bin").exists());
    // a listing we hold is updated too
    eventually("listing", || {
        let mut names: Vec<String> = fs::read_dir(ours.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        names.sort();
        names == ["wdir2"]
    });

    // filer HTTP API uploads, new and overwritten
    w.filer_put(&format!("{root}/http.txt"), b"from http v1", "");
    assert_reads("http upload", &ours.join("http.txt"), b"from http v1");
    w.filer_put(
        &format!("{root}/http.txt"),
        b"from http, second version",
        "",
    );
    assert_reads(
        "http overwrite",
        &ours.join("http.txt"),
        b"from http, second version",
    );
    // and what the HTTP API wrote, weed mount and we agree on
    assert_reads(
        "http upload via weed",
        &weed.join("http.txt"),
        b"from http, second version",
    );
}

#[test]
fn both_mounts_edit_the_same_tree() {
    let w = shared_server();
    let root = unique_path("both");
    let ours = mount_ours(&w, &root, &[]);
    let weed = mount_weed(&w, &root);
    // interleaved edits of one directory from both sides
    for i in 0..20 {
        let (src, name) = if i % 2 == 0 {
            (&ours, format!("o{i}"))
        } else {
            (&weed, format!("w{i}"))
        };
        fs::write(src.join(&name), format!("content {i}")).unwrap();
    }
    for i in 0..20 {
        let name = if i % 2 == 0 {
            format!("o{i}")
        } else {
            format!("w{i}")
        };
        let want = format!("content {i}");
        assert_reads("ours", &ours.join(&name), want.as_bytes());
        assert_reads("weed", &weed.join(&name), want.as_bytes());
    }
    // a file written by us and then by weed: the last writer wins everywhere
    fs::write(ours.join("shared"), b"first, by us").unwrap();
    assert_reads("weed sees ours", &weed.join("shared"), b"first, by us");
    fs::write(weed.join("shared"), b"second, by weed mount").unwrap();
    assert_reads(
        "we see weed's",
        &ours.join("shared"),
        b"second, by weed mount",
    );
    assert_eq!(
        w.filer_get(&format!("{root}/shared")).unwrap(),
        b"second, by weed mount"
    );
}

#[test]
fn open_files_follow_renames_and_deletes_by_others() {
    let w = shared_server();
    let root = unique_path("follow");
    let ours = mount_ours(&w, &root, &[]);
    let weed = mount_weed(&w, &root);
    let http = |p: &str| w.filer_get(&format!("{root}/{p}"));

    // a file open for writing here, renamed by weed mount: our later data lands at the new name
    let mut f = fs::File::create(ours.join("moving")).unwrap();
    f.write_all(b"part one;").unwrap();
    f.sync_all().unwrap();
    assert_reads("weed sees it", &weed.join("moving"), b"part one;");
    fs::rename(weed.join("moving"), weed.join("moved")).unwrap();
    eventually("rename seen", || !ours.join("moving").exists());
    f.write_all(b"part two").unwrap();
    drop(f);
    assert_eq!(http("moved").as_deref(), Some(&b"part one;part two"[..]));
    assert!(http("moving").is_none(), "not re-created at the old name");

    // the same for a file inside a directory renamed by weed mount, and a cwd-relative path
    fs::create_dir(ours.join("d")).unwrap();
    let mut g = fs::File::create(ours.join("d/inner")).unwrap();
    g.write_all(b"inner;").unwrap();
    g.sync_all().unwrap();
    let dir_fd = fs::File::open(ours.join("d")).unwrap();
    assert_reads("weed sees inner", &weed.join("d/inner"), b"inner;");
    fs::rename(weed.join("d"), weed.join("d2")).unwrap();
    eventually("dir rename seen", || ours.join("d2/inner").exists());
    g.write_all(b"more").unwrap();
    drop(g);
    assert_eq!(http("d2/inner").as_deref(), Some(&b"inner;more"[..]));
    assert!(http("d/inner").is_none());
    // a directory fd taken before the rename still resolves names in the moved directory
    let name = std::ffi::CString::new("inner").unwrap();
    let fd = unsafe { libc::openat(dir_fd.as_raw_fd(), name.as_ptr(), libc::O_RDONLY) };
    assert!(
        fd >= 0,
        "openat in a directory renamed elsewhere: {}",
        errno()
    );
    unsafe { libc::close(fd) };

    // a file open here and deleted by weed mount is not resurrected by our close
    let mut h = fs::File::create(ours.join("doomed")).unwrap();
    h.write_all(b"x").unwrap();
    h.sync_all().unwrap();
    assert_reads("weed sees doomed", &weed.join("doomed"), b"x");
    fs::remove_file(weed.join("doomed")).unwrap();
    eventually("delete seen", || !ours.join("doomed").exists());
    h.write_all(b"yy").unwrap();
    drop(h);
    assert!(http("doomed").is_none(), "deleted file came back");

    // a file open here and replaced by a rename on weed mount
    fs::write(ours.join("victim"), b"old").unwrap();
    let mut v = fs::OpenOptions::new()
        .write(true)
        .open(ours.join("victim"))
        .unwrap();
    fs::write(weed.join("replacement"), b"new").unwrap();
    assert_reads("weed sees victim", &weed.join("victim"), b"old");
    fs::rename(weed.join("replacement"), weed.join("victim")).unwrap();
    assert_reads("replacement seen", &ours.join("victim"), b"new");
    v.write_all(b"clobber").unwrap();
    drop(v);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(http("victim").as_deref(), Some(&b"new"[..]));
}

#[test]
fn hard_links_across_mounts() {
    let w = shared_server();
    let root = unique_path("hl");
    let ours = mount_ours(&w, &root, &[]);
    let weed = mount_weed(&w, &root);
    let nlink = |p: &Path| fs::symlink_metadata(p).map(|m| m.nlink()).unwrap_or(0);

    // ours -> weed
    fs::write(ours.join("a"), b"one\n").unwrap();
    fs::hard_link(ours.join("a"), ours.join("b")).unwrap();
    eventually("weed sees 2 links", || {
        nlink(&weed.join("a")) == 2 && nlink(&weed.join("b")) == 2
    });
    assert_eq!(
        fs::metadata(weed.join("a")).unwrap().ino(),
        fs::metadata(weed.join("b")).unwrap().ino()
    );
    let mut f = OpenOptions::new()
        .append(true)
        .open(weed.join("b"))
        .unwrap();
    f.write_all(b"two\n").unwrap();
    drop(f);
    assert_reads(
        "append by weed through the other link",
        &ours.join("a"),
        b"one\ntwo\n",
    );
    assert_reads("and through this link", &ours.join("b"), b"one\ntwo\n");

    // weed -> ours
    fs::write(weed.join("x"), b"x").unwrap();
    fs::hard_link(weed.join("x"), weed.join("y")).unwrap();
    eventually("we see 2 links", || {
        nlink(&ours.join("x")) == 2 && nlink(&ours.join("y")) == 2
    });
    assert_eq!(
        fs::metadata(ours.join("x")).unwrap().ino(),
        fs::metadata(ours.join("y")).unwrap().ino()
    );
    fs::remove_file(weed.join("x")).unwrap();
    eventually("x gone", || !ours.join("x").exists());
    eventually("y has one link", || nlink(&ours.join("y")) == 1);
    assert_eq!(fs::read(ours.join("y")).unwrap(), b"x");
}

/// The kernel keeps directory listings across opens; names created, renamed and deleted by
/// other clients must still show up in a listing we already hold.
#[test]
fn cached_listings_follow_other_clients() {
    let w = shared_server();
    let root = unique_path("listings");
    let ours = mount_ours(&w, &root, &[]);
    let weed = mount_weed(&w, &root);
    let names = |dir: &Path| -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        v.sort();
        v
    };
    fs::create_dir(ours.join("d")).unwrap();
    for i in 0..50 {
        fs::write(ours.join(format!("d/f{i:02}")), b"x").unwrap();
    }
    let listed = names(&ours.join("d"));
    assert_eq!(listed.len(), 50);
    // read twice: the second listing comes from the kernel's cache
    assert_eq!(names(&ours.join("d")), listed);

    w.filer_put(&format!("{root}/d/from_http"), b"h", "");
    eventually("a name added over HTTP", || {
        names(&ours.join("d")).contains(&"from_http".to_string())
    });
    fs::remove_file(weed.join("d/f00")).unwrap();
    eventually("a name deleted by weed mount", || {
        !names(&ours.join("d")).contains(&"f00".to_string())
    });
    fs::rename(weed.join("d/f01"), weed.join("d/renamed")).unwrap();
    eventually("a name renamed by weed mount", || {
        let n = names(&ours.join("d"));
        n.contains(&"renamed".to_string()) && !n.contains(&"f01".to_string())
    });
    assert_eq!(names(&ours.join("d")).len(), 50);
    // and our own changes show at once
    fs::write(ours.join("d/local"), b"l").unwrap();
    assert!(names(&ours.join("d")).contains(&"local".to_string()));
    fs::remove_file(ours.join("d/local")).unwrap();
    assert!(!names(&ours.join("d")).contains(&"local".to_string()));
}

/// A file open here with a write not committed yet, while another node adds a third name to
/// its link group: our close must not write back the link count we knew (2). The filer keeps
/// the group's content while its count says names are left, so with a count one too low,
/// removing two names would delete the content the third one still shows.
#[test]
fn a_close_keeps_a_hard_link_count_another_node_raised() {
    let w = shared_server();
    let root = unique_path("hlcount");
    let a = mount_ours(&w, &root, &[]);
    let b = mount_ours(&w, &root, &[]);
    let nlink = |p: &Path| fs::symlink_metadata(p).map(|m| m.nlink()).unwrap_or(0);
    fs::write(a.join("f"), b"base").unwrap();
    fs::hard_link(a.join("f"), a.join("l")).unwrap();
    eventually("b sees 2 links", || nlink(&b.join("f")) == 2);
    let f = OpenOptions::new().write(true).open(a.join("f")).unwrap();
    f.write_all_at(b"NEW!", 0).unwrap();
    fs::hard_link(b.join("f"), b.join("l3")).unwrap();
    eventually("a sees the third name", || a.join("l3").exists());
    f.sync_all().unwrap();
    // (once the kernel's cached attributes expire)
    eventually("the open file shows 3 links", || {
        f.metadata().is_ok_and(|m| m.nlink() == 3)
    });
    drop(f);
    assert_reads("the close through the third name", &b.join("l3"), b"NEW!");
    fs::remove_file(b.join("f")).unwrap();
    fs::remove_file(b.join("l")).unwrap();
    assert_reads(
        "the last name after two were removed",
        &b.join("l3"),
        b"NEW!",
    );
    let http = w.filer_get(&format!("{root}/l3"));
    assert_eq!(http.as_deref(), Some(&b"NEW!"[..]), "over HTTP");
}

/// A file open here with a write not committed yet gets a second name on another node, and
/// then its first name is removed, there or here (`ln f l; rm f`, a move by link): our close
/// writes to `l`, the name the file lives on under, and nothing we wrote is lost, also when
/// nothing here looked `l` up (only the other node's events named it). Where both names are
/// removed, the close brings neither back.
#[test]
fn a_close_follows_a_file_linked_away_and_removed() {
    let w = shared_server();
    for case in [
        "removed there",
        "removed there, l unseen here",
        // no change of f here lately: the removal is believed at once, not re-read
        "made there, removed there, l unseen here",
        // f, l and m; f removed, then the name a moved to (m, the newest): l is left
        "made there, l and m unseen here, f then m removed there",
        "removed here",
        "both removed there",
    ] {
        let root = unique_path("hlaway");
        let a = mount_ours(&w, &root, &[]);
        let b = mount_ours(&w, &root, &[]);
        let maker = if case.starts_with("made there") {
            &b
        } else {
            &a
        };
        fs::write(maker.join("f"), b"base").unwrap();
        assert_reads("a sees f", &a.join("f"), b"base");
        assert_reads("b sees f", &b.join("f"), b"base");
        let f = OpenOptions::new().write(true).open(a.join("f")).unwrap();
        f.write_all_at(b"NEW!", 0).unwrap();
        fs::hard_link(b.join("f"), b.join("l")).unwrap();
        let two = case.contains("l and m");
        if two {
            fs::hard_link(b.join("f"), b.join("m")).unwrap();
        }
        if case.contains("unseen") {
            std::thread::sleep(Duration::from_secs(1));
        } else {
            eventually("a sees the new name", || a.join("l").exists());
        }
        let remover = if case == "removed here" { &a } else { &b };
        fs::remove_file(remover.join("f")).unwrap();
        if case == "both removed there" {
            fs::remove_file(b.join("l")).unwrap();
            eventually("a sees l gone", || !a.join("l").exists());
        }
        eventually("a sees f gone", || !a.join("f").exists());
        if two {
            std::thread::sleep(Duration::from_secs(1));
            fs::remove_file(b.join("m")).unwrap();
        }
        std::thread::sleep(Duration::from_secs(1));
        drop(f);
        let l = w.filer_get(&format!("{root}/l"));
        if case == "both removed there" {
            assert!(l.is_none(), "{case}: l came back");
        } else {
            assert_eq!(l.as_deref(), Some(&b"NEW!"[..]), "{case}: l over HTTP");
            assert_reads("b reads l", &b.join("l"), b"NEW!");
        }
        assert!(
            w.filer_get(&format!("{root}/f")).is_none(),
            "{case}: f came back"
        );
        assert!(
            w.filer_get(&format!("{root}/m")).is_none(),
            "{case}: m came back"
        );
    }
}

/// An upload over one name of a hard-linked file (the filer's HTTP API, S3) replaces that
/// name with a new file that keeps the old number: the other name still holds the old file,
/// and every mount shows two files, each with its own bytes, size and link count (`c` met
/// the names only in a listing, `ls -l`, never by lookup).
#[test]
fn an_upload_over_a_hard_links_name_leaves_its_other_name_alone() {
    let w = shared_server();
    let root = unique_path("hlput");
    let a = mount_ours(&w, &root, &[]);
    let b = mount_ours(&w, &root, &[]);
    let c = mount_ours(&w, &root, &[]);
    let old: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    fs::write(a.join("f"), &old).unwrap();
    fs::hard_link(a.join("f"), a.join("l")).unwrap();
    assert_reads("b sees l", &b.join("l"), &old);
    assert_eq!(fs::metadata(b.join("f")).unwrap().nlink(), 2);
    let listed = || -> Vec<(String, u64, u64)> {
        let mut v: Vec<_> = fs::read_dir(&c.dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let md = e.metadata().unwrap();
                (e.file_name().to_string_lossy().into(), md.len(), md.nlink())
            })
            .collect();
        v.sort();
        v
    };
    let n = old.len() as u64;
    eventually("c lists f and l", || {
        listed() == vec![("f".into(), n, 2), ("l".into(), n, 2)]
    });
    // held open on `a`, where the group's node was made at `f`
    let held = fs::File::open(a.join("l")).unwrap();
    w.filer_put(&format!("{root}/f"), b"new file", "");
    assert_eq!(
        w.filer_get(&format!("{root}/l")).as_deref(),
        Some(&old[..]),
        "l over HTTP"
    );
    // before anything on `a` looks `f` up again: the event alone must part the two files
    assert_reads("f on b", &b.join("f"), b"new file");
    std::thread::sleep(Duration::from_millis(500));
    let md = held.metadata().unwrap();
    assert_eq!(
        (md.len(), md.nlink()),
        (old.len() as u64, 1),
        "the open l on a: size and links"
    );
    let mut back = Vec::new();
    std::io::Read::read_to_end(&mut &held, &mut back).unwrap();
    assert!(back == old, "the open l on a reads other bytes");
    eventually("c lists the upload", || {
        listed() == vec![("f".into(), 8, 1), ("l".into(), n, 1)]
    });
    for m in [&a, &b, &c] {
        assert_reads("f after the upload", &m.join("f"), b"new file");
        assert_reads("l after the upload", &m.join("l"), &old);
        let (f, l) = (
            fs::metadata(m.join("f")).unwrap(),
            fs::metadata(m.join("l")).unwrap(),
        );
        assert_ne!(
            f.ino(),
            l.ino(),
            "{}: f and l are one inode",
            m.dir.display()
        );
        assert_eq!(l.len(), old.len() as u64);
        assert_eq!(l.nlink(), 1, "{}: l's links", m.dir.display());
        assert_eq!(f.nlink(), 1, "{}: f's links", m.dir.display());
    }
}

/// A file open here with a write not committed yet becomes a hard link on another node: our
/// close writes the file as one of the link group, so both names show what we wrote, and
/// removing one leaves the other.
#[test]
fn a_close_keeps_a_hard_link_another_node_made_meanwhile() {
    let w = shared_server();
    let root = unique_path("hlfirst");
    let a = mount_ours(&w, &root, &[]);
    let b = mount_ours(&w, &root, &[]);
    fs::write(a.join("f"), b"base").unwrap();
    assert_reads("b sees f", &b.join("f"), b"base");
    let f = OpenOptions::new().write(true).open(a.join("f")).unwrap();
    f.write_all_at(b"NEW!", 0).unwrap();
    fs::hard_link(b.join("f"), b.join("l")).unwrap();
    eventually("a sees the new name", || a.join("l").exists());
    // a lookup can find `l` at the filer before the event that made `f` a link reaches a
    std::thread::sleep(Duration::from_secs(1));
    drop(f);
    assert_reads("the close through the new name", &b.join("l"), b"NEW!");
    assert_eq!(
        w.filer_get(&format!("{root}/l")).as_deref(),
        Some(&b"NEW!"[..]),
        "l over HTTP"
    );
    fs::remove_file(b.join("f")).unwrap();
    assert_reads("l after f was removed", &b.join("l"), b"NEW!");
    assert_eq!(
        w.filer_get(&format!("{root}/l")).as_deref(),
        Some(&b"NEW!"[..]),
        "l over HTTP, f removed"
    );
}

/// Metadata changes on one node race commits on another: `a` changes the mode of `f` over
/// and over while `b` writes new content into it and closes, many times. Every close's bytes
/// must survive `a`'s next changes: a chmod is stored only onto the chunks it looked up.
/// (Before, a chmod whose lookup came just before `b`'s commit wrote the old chunk list
/// back, and the filer deleted `b`'s new chunk.)
#[test]
fn metadata_changes_on_one_node_keep_anothers_fresh_writes() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let w = shared_server();
    let root = unique_path("casmeta");
    let a = mount_ours(&w, &root, &[]);
    let b = mount_ours(&w, &root, &[]);
    fs::write(b.join("f"), b"v0").unwrap();
    eventually("a sees f", || a.join("f").exists());
    let stop = Arc::new(AtomicBool::new(false));
    let chmods = {
        let (p, stop) = (a.join("f"), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let mode = if n % 2 == 0 { 0o600 } else { 0o644 };
                fs::set_permissions(&p, fs::Permissions::from_mode(mode))
                    .unwrap_or_else(|e| panic!("chmod {n} on a: {e}"));
                n += 1;
            }
            n
        })
    };
    let path = format!("{root}/f");
    let mut failed = None;
    for i in 1..=40 {
        let data = format!("round {i};").repeat(500 + i);
        fs::write(b.join("f"), &data).unwrap();
        // a's chmods in flight when the close committed are done by now
        std::thread::sleep(Duration::from_millis(30));
        if w.filer_get(&path).as_deref() != Some(data.as_bytes()) {
            failed = Some(i);
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let n = chmods.join().expect("the chmod loop");
    assert_eq!(
        failed, None,
        "b's write was undone by a's chmod ({n} chmods)"
    );
    assert!(n > 40, "only {n} chmods raced the writes");
}

/// Two nodes write different parts of one file through handles they keep open, and fsync:
/// every round, `b` writes first and holds its bytes, `a` writes and commits, then `b`
/// commits onto an entry it no longer has the latest of. Both nodes' bytes must be on the
/// filer and read back through both mounts. (Before, `b`'s commit listed the chunks of the
/// entry it had started from, and the filer deleted `a`'s new chunk: last writer wins.)
/// Then `b` truncates while `a` writes on both sides of the cut: `a`'s bytes below the cut
/// stay, those past it go, as if `a`'s write had come first.
#[test]
fn concurrent_writes_to_one_file_on_two_nodes_both_land() {
    let w = shared_server();
    let root = unique_path("merge");
    let a = mount_ours(&w, &root, &[]);
    let b = mount_ours(&w, &root, &[]);
    let path = format!("{root}/f");
    let mut want = vec![b'.'; 3 << 20];
    fs::write(a.join("f"), &want).unwrap();
    eventually("b sees f whole", || {
        fs::metadata(b.join("f")).is_ok_and(|m| m.len() == want.len() as u64)
    });
    let fa = OpenOptions::new().write(true).open(a.join("f")).unwrap();
    let fb = OpenOptions::new().write(true).open(b.join("f")).unwrap();
    let put = |want: &mut Vec<u8>, off: usize, data: &[u8]| {
        if want.len() < off + data.len() {
            want.resize(off + data.len(), 0);
        }
        want[off..off + data.len()].copy_from_slice(data);
    };
    let check = |want: &[u8], what: &str| {
        assert_filer_has(&w, &path, want, what);
        let through_b = fs::read(b.join("f")).unwrap();
        assert!(
            through_b == want,
            "{what}: b reads other bytes than the filer has"
        );
        eventually(&format!("{what}: a reads what the filer has"), || {
            fs::read(a.join("f")).is_ok_and(|d| d == want)
        });
    };
    for round in 0..8u8 {
        let (da, db) = (vec![b'a' + round; 5000], vec![b'A' + round; 7000]);
        let ob = (2 << 20) + usize::from(round) * 9000;
        // a's last write appends: b's commit must keep the longer size too
        let oa = if round == 7 {
            want.len()
        } else {
            usize::from(round) * 9000
        };
        fb.write_all_at(&db, ob as u64).unwrap();
        fa.write_all_at(&da, oa as u64).unwrap();
        fa.sync_all().unwrap();
        fb.sync_all().unwrap();
        put(&mut want, ob, &db);
        put(&mut want, oa, &da);
        check(&want, &format!("round {round}"));
    }
    // b writes at the start, a writes below and past 1 MiB and commits, then b cuts the
    // file at 1 MiB (committed at once): a's bytes below the cut stay, those past it go
    fb.write_all_at(b"cut by b", 0).unwrap();
    fa.write_all_at(&[b'x'; 3000], 512 << 10).unwrap();
    fa.write_all_at(&[b'y'; 3000], 2 << 20).unwrap();
    fa.sync_all().unwrap();
    fb.set_len(1 << 20).unwrap();
    put(&mut want, 512 << 10, &[b'x'; 3000]);
    put(&mut want, 0, b"cut by b");
    want.truncate(1 << 20);
    check(&want, "after b's truncate");
    // b rewrites the file (O_TRUNC, a truncate the kernel sends apart and that is committed
    // at once) while a writes into the emptied file and commits: b's close keeps a's write
    // past b's content
    let mut fb2 = OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(b.join("f"))
        .unwrap();
    want.clear();
    let rewritten = vec![b'n'; 1536 << 10];
    fb2.write_all(&rewritten).unwrap();
    fa.write_all_at(&[b'z'; 3000], 100 << 10).unwrap();
    fa.write_all_at(&[b'z'; 3000], 3 << 20).unwrap();
    fa.sync_all().unwrap();
    drop(fb2);
    put(&mut want, 100 << 10, &[b'z'; 3000]);
    put(&mut want, 3 << 20, &[b'z'; 3000]);
    put(&mut want, 0, &rewritten);
    check(&want, "after b's rewrite");
}

/// The filer serves `want` at `path` (over HTTP), else says how much of it differs.
fn assert_filer_has(w: &common::WeedServer, path: &str, want: &[u8], what: &str) {
    let got = w.filer_get(path).unwrap_or_default();
    assert!(
        got == want,
        "{what}: the filer has {} bytes, {} differ from both clients' writes (first at {:?})",
        got.len(),
        got.iter().zip(want).filter(|(x, y)| x != y).count() + got.len().abs_diff(want.len()),
        got.iter().zip(want).position(|(x, y)| x != y)
    );
}

/// The same with `weed mount` as the other writer: its commits carry no condition, and ours
/// are rebased onto them, so `weed mount`'s bytes and ours both stay.
#[test]
fn concurrent_writes_with_weed_mount_on_one_file_both_land() {
    let w = shared_server();
    let root = unique_path("mergeweed");
    let ours = mount_ours(&w, &root, &[]);
    let weed = mount_weed(&w, &root);
    let path = format!("{root}/f");
    let mut want = vec![b'.'; 3 << 20];
    fs::write(ours.join("f"), &want).unwrap();
    eventually("weed mount sees f whole", || {
        fs::metadata(weed.join("f")).is_ok_and(|m| m.len() == want.len() as u64)
    });
    let f_ours = OpenOptions::new().write(true).open(ours.join("f")).unwrap();
    for round in 0..4u8 {
        let (dw, dour) = (vec![b'w' - round; 6000], vec![b'O' + round; 6000]);
        let (ow, oour) = (
            usize::from(round) * 10_000,
            (2 << 20) + usize::from(round) * 10_000,
        );
        f_ours.write_all_at(&dour, oour as u64).unwrap();
        {
            let f_weed = OpenOptions::new().write(true).open(weed.join("f")).unwrap();
            f_weed.write_all_at(&dw, ow as u64).unwrap();
            f_weed.sync_all().unwrap();
        }
        f_ours.sync_all().unwrap();
        want[ow..ow + dw.len()].copy_from_slice(&dw);
        want[oour..oour + dour.len()].copy_from_slice(&dour);
        assert_filer_has(&w, &path, &want, &format!("round {round}"));
    }
}
