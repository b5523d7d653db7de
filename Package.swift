// swift-tools-version:6.0
// storefs: a read-only FUSE filesystem over a Google Cloud Storage / Firebase Storage bucket.
// Layers, following the read path: CFuse3/CCurl (C shims) → StorageClient (HTTP + protocols)
// → StorefsCore (namespace, handles, errno) → FuseAdapter (libfuse glue) → storefs (executable).
import PackageDescription

let strict: [SwiftSetting] = [.unsafeFlags(["-warnings-as-errors"])]

let package = Package(
    name: "storefs",
    products: [
        .executable(name: "storefs", targets: ["storefs"]),
    ],
    targets: [
        .systemLibrary(name: "CFuse3", pkgConfig: "fuse3", providers: [.apt(["libfuse3-dev"])]),
        .target(name: "CCurl", linkerSettings: [.linkedLibrary("curl"), .linkedLibrary("ssl"), .linkedLibrary("crypto")]),
        .target(name: "CChecksum", linkerSettings: [.linkedLibrary("crypto")]),
        .target(name: "CBlockCache"),
        .target(name: "CCrypto", linkerSettings: [.linkedLibrary("crypto")]),
        .target(name: "CProcess"),
        .target(name: "CZlib", linkerSettings: [.linkedLibrary("z")]),
        // The lock order and its debug-build check (docs/architecture.md, "Threads and locks").
        .target(name: "Locking", swiftSettings: strict),
        .target(name: "StorageClient", dependencies: ["Locking", "CCurl", "CCrypto", "CChecksum"], swiftSettings: strict),
        .target(name: "StorefsCore", dependencies: ["Locking", "StorageClient", "CBlockCache", "CChecksum", "CProcess", "CZlib"], swiftSettings: strict),
        .target(name: "FuseAdapter", dependencies: ["Locking", "StorefsCore", "CFuse3"], swiftSettings: strict),
        .executableTarget(name: "storefs", dependencies: ["FuseAdapter", "StorefsCore", "StorageClient"],
                          swiftSettings: strict),
        // What the test targets share: an in-memory bucket (MemoryStore).
        .target(name: "StorefsTestSupport", dependencies: ["StorageClient", "CChecksum"], path: "Tests/StorefsTestSupport"),
        .testTarget(name: "LockingTests", dependencies: ["Locking"]),
        .testTarget(name: "StorageClientTests", dependencies: ["StorageClient"]),
        .testTarget(name: "StorefsCoreTests", dependencies: ["StorefsCore", "StorageClient", "StorefsTestSupport"]),
        .testTarget(name: "FuseAdapterTests", dependencies: ["FuseAdapter", "StorefsCore", "StorageClient", "StorefsTestSupport"]),
        // The command line (options, usage, subcommands), in the executable's target.
        .testTarget(name: "StorefsCommandTests", dependencies: ["storefs", "StorefsCore", "StorageClient"]),
    ]
)
