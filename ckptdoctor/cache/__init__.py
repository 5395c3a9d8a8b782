"""The verdict cache: each file's facts and pickle verdict kept in the user's cache folder, so that a rescan reads
only the files that changed (``source.FactsCache``), stored in a format that decodes without running anything
(``codec``), in files only this user's ckptdoctor can have written (``store``)."""
