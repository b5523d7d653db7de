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
        .target(name: "CBlockCache", linkerSettings: [.linkedLibrary("crypto")]),
        .target(name: "CCrypto", linkerSettings: [.linkedLibrary("crypto")]),
        .target(name: "CProcess"),
        .target(name: "CZlib", linkerSettings: [.linkedLibrary("z")]),
        .target(name: "StorageClient", dependencies: ["CCurl", "CCrypto", "CBlockCache"], swiftSettings: strict),
        .target(name: "StorefsCore", dependencies: ["StorageClient", "CBlockCache", "CProcess", "CZlib"],
                swiftSettings: strict),
        .target(name: "FuseAdapter", dependencies: ["StorefsCore", "CFuse3"], swiftSettings: strict),
        .executableTarget(name: "storefs", dependencies: ["FuseAdapter", "StorefsCore", "StorageClient"],
                          swiftSettings: strict),
        .testTarget(name: "StorageClientTests", dependencies: ["StorageClient"]),
        .testTarget(name: "StorefsCoreTests", dependencies: ["StorefsCore", "StorageClient"]),
        .testTarget(name: "FuseAdapterTests", dependencies: ["FuseAdapter", "StorefsCore", "StorageClient"]),
    ]
)
