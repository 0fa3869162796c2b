//! Links the system's libfabric (found with pkg-config), compiles the shim of its static
//! inline calls, and generates bindings for the API railyard uses.

use std::path::PathBuf;

fn main() {
    let library = pkg_config::Config::new()
        .atleast_version("1.17")
        .probe("libfabric")
        .unwrap_or_else(|error| {
            panic!(
                "libfabric (>= 1.17) not found: {error}\n\
                 install it with `apt-get install libfabric-dev` (`make deps` does)"
            )
        });
    println!("cargo:rerun-if-changed=shim.h");
    println!("cargo:rerun-if-changed=shim.c");
    let mut shim = cc::Build::new();
    shim.file("shim.c");
    for path in &library.include_paths {
        shim.include(path);
    }
    shim.compile("railyard_ofi_shim");

    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindgen::Builder::default()
        .header("shim.h")
        .clang_args(
            library
                .include_paths
                .iter()
                .map(|path| format!("-I{}", path.display())),
        )
        .allowlist_function("railyard_fi_.*")
        .allowlist_function("fi_getinfo|fi_freeinfo|fi_dupinfo|fi_allocinfo|fi_strerror|fi_version")
        .allowlist_type("fi_.*|fid_.*|fid")
        .allowlist_var("FI_.*")
        .blocklist_type("iovec")
        .raw_line("use libc::iovec;")
        .size_t_is_usize(true)
        .derive_default(true)
        .layout_tests(false)
        .generate()
        .expect("libfabric's headers produce bindings")
        .write_to_file(out.join("bindings.rs"))
        .expect("the bindings are written");
}
